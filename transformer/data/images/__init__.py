"""Images: where they come from, how one becomes a view, and the batches of a run.

  sources.py        `load`: the in-memory sources (digits, IDX, .npz) or a folder's index, as splits
  splits.py         a split: in memory (shared with the workers) or files; the fixed test split
  folders.py        folders of image files indexed once into WORKDIR/images/, shared by a sweep
  normalisation.py  the per-channel statistics a run normalises by, and the normalisation
  host_views.py     the train and eval views in numpy and Pillow (the recipe), for the workers
  device_views.py   the same train views made inside the jitted step, for in-memory uint8 images
  batches.py        step-indexed batches made by worker processes, the eval batches, statistics
"""
