"""Folders of image files, indexed once (file names and labels, nothing decoded) into the run's
WORKDIR/images/.

Glossary: N images of a split.

A folder (`config.data.source`) is ImageFolder's DIR/train/CLASS/* with DIR/val/CLASS/* or
DIR/test/CLASS/*, or DIR/CLASS/* alone (then split by `splits.split`'s fixed permutation,
`test_fraction`); ImageNet's flat DIR/val/* takes its labels from `config.data.val_labels`
(lines `FILE,CLASS ...`: its LOC_val_solution.csv, or `FILE<tab>CLASS`). Class names sorted ->
ids; files are JPEG/PNG/BMP/GIF/WebP, or .npy arrays [H, W(, C)]. The index is each split's
paths [N] and labels [N] as .npy files, memory-mapped by `splits.FileSplit`, and index.json;
a resumed run reads it back, and a sweep's trials share one (`share_index`). Where the run already
names its classes (`names`: a trained run evaluated on another folder, a converted classifier), a
class folder takes the id of its name there, and a folder the run does not name fails naming it.
"""

import contextlib
import glob
import json
import os
import shutil
import sys

import numpy as np

from transformer import console
from transformer.data.images.splits import SPLIT_SEED, FileSplit
from transformer.data.text import labelled

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")


def _image_files(folder: str) -> list[str]:
    with os.scandir(folder) as entries:
        return sorted(e.name for e in entries if e.is_file() and e.name.lower().endswith((".npy", *IMAGE_EXTENSIONS)))


def image_files(path: str) -> list[str]:
    """The image files (.npy and IMAGE_EXTENSIONS) in folder `path` and its sub-folders, sorted; or [path]
    where it is one such file ([] for any other file)."""
    extensions = (".npy", *IMAGE_EXTENSIONS)
    if os.path.isdir(path):
        return sorted(os.path.join(d, f) for d, _, files in os.walk(path) for f in files
                      if f.lower().endswith(extensions))
    return [path] if path.lower().endswith(extensions) else []


def input_images(path: str) -> list[str]:
    """The images a classifier's --input names: a folder's (`image_files`), one image file, or a text file
    naming one a line (relative to its folder)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"--input={path}: no such file or folder")
    found = image_files(path)
    if not found and os.path.isdir(path):
        raise ValueError(f"--input={path}: no image files (.npy, {', '.join(IMAGE_EXTENSIONS)}) in the folder")
    return found or [os.path.join(os.path.dirname(path), p) for p in labelled.input_lines(path)]


def _classes(base: str) -> list[str]:
    classes = sorted(d for d in os.listdir(base) if os.path.isdir(os.path.join(base, d)))
    if not classes:
        raise ValueError(f"{base}: no class sub-folders")
    return classes


def index_class_folders(root: str, base: str, classes: list[str], show: bool) -> tuple[list[str], list[int]]:
    """(paths relative to `root`, labels) of the image files in base/CLASS/, classes in order."""
    paths, labels = [], []
    for label, name in enumerate(console.progress(classes, desc=f"indexing {base}", disable=not show, leave=False)):
        folder = os.path.join(base, name)
        files = _image_files(folder)
        paths += [os.path.relpath(os.path.join(folder, f), root) for f in files]
        labels += [label] * len(files)
    if not paths:
        raise _no_images(base)
    return paths, labels


def _no_images(base: str) -> ValueError:
    return ValueError(f"{base}: no images (.npy, {', '.join(IMAGE_EXTENSIONS)}) in its class folders")


def index_flat_folder(root: str, folder: str, classes: list[str], labels_file: str) -> tuple[list[str], list[int]]:
    """ImageNet's flat val/: each file's class from `labels_file`, lines `FILE,CLASS ...` or `FILE<tab>CLASS`
    (CLASS a class folder's name or its id; FILE with or without its extension; a header line is skipped)."""
    ids = {name: i for i, name in enumerate(classes)}
    by_stem = {}
    with open(os.path.expanduser(labels_file)) as f:
        for number, line in enumerate(f, 1):
            fields = line.replace(",", "\t", 1).split("\t") if "," in line or "\t" in line else line.split(None, 1)
            if len(fields) < 2:
                continue
            name, value = fields[0].strip(), (fields[1].split() or [""])[0]
            label = ids.get(value, int(value) if value.isdigit() else None)
            if label is None or not 0 <= label < len(classes):
                if number == 1:
                    continue  # a header
                raise ValueError(f"{labels_file}:{number}: {value!r} is neither a class folder of the train split "
                                 f"nor an id below {len(classes)}")
            by_stem[os.path.splitext(os.path.basename(name))[0]] = label
    files = _image_files(folder)
    missing = [f for f in files if os.path.splitext(f)[0] not in by_stem]
    if missing:
        raise ValueError(f"{labels_file}: no label for {len(missing)} file(s) of {folder}, e.g. {missing[0]}")
    return [os.path.relpath(os.path.join(folder, f), root) for f in files], [by_stem[os.path.splitext(f)[0]]
                                                                            for f in files]


def layout(root: str) -> tuple[str, str | None]:
    """(the folder of the train split's class folders, the held-out split's folder or None) of an image
    folder: ROOT/train with ROOT/val (or ROOT/test), else ROOT alone."""
    evals = [s for s in ("val", "test") if os.path.isdir(os.path.join(root, s))]
    if not os.path.isdir(os.path.join(root, "train")) or not evals:
        return root, None
    return os.path.join(root, "train"), os.path.join(root, evals[0])


def sample(data_config, count: int = 32) -> tuple[list[str], list[str]]:
    """(class names, up to `count` image files from up to 16 classes spread over them) of the folder
    `config.data.source`, without indexing it: its classes as the index will find them, and a few files
    whose headers say what its images are like."""
    base = layout(os.path.abspath(os.path.expanduser(data_config.source)))[0]
    classes = _classes(base)
    picked = classes[::-(-len(classes) // 16)]
    files = [os.path.join(base, name, f) for name in picked
             for f in _image_files(os.path.join(base, name))[:-(-count // len(picked))]]
    if not files:
        raise _no_images(base)
    return classes, files[:count]


def index_folder(root: str, test_fraction: float, val_labels: str = "", show: bool = False,
                 names: list[str] | None = None) -> tuple[list, dict]:
    """(class names, {'train': (paths, labels), 'test': (...)}) of an image folder (see the module docstring),
    the ids those of `names` where given."""
    classes, splits = _index_folder(root, test_fraction, val_labels, show)
    if not names:
        return classes, splits
    unknown = [c for c in classes if c not in names]
    if unknown:
        raise ValueError(f"{root}: class folders {', '.join(unknown[:5])} are not among the run's classes "
                         f"({', '.join(names[:10])}{', ...' if len(names) > 10 else ''})")
    ids = [names.index(c) for c in classes]
    return list(names), {s: (paths, [ids[label] for label in labels]) for s, (paths, labels) in splits.items()}


def _index_folder(root: str, test_fraction: float, val_labels: str, show: bool) -> tuple[list, dict]:
    base, held_out = layout(root)
    if held_out is None:
        classes = _classes(root)
        paths, labels = index_class_folders(root, root, classes, show)
        order = np.random.default_rng(SPLIT_SEED).permutation(len(paths))
        n_test = int(round(len(paths) * test_fraction))
        pick = lambda rows: ([paths[i] for i in rows], [labels[i] for i in rows])  # noqa: E731
        return classes, {"train": pick(order[n_test:]), "test": pick(order[:n_test])}
    classes = _classes(base)
    splits = {"train": index_class_folders(root, base, classes, show)}
    if val_labels:
        splits["test"] = index_flat_folder(root, held_out, classes, val_labels)
    else:
        if _classes(held_out) != classes:
            raise ValueError(f"{held_out}: its class folders differ from {base}'s (a flat "
                             "folder of files needs config.data.val_labels)")
        splits["test"] = index_class_folders(root, held_out, classes, show)
    return classes, splits


INDEX_DIR = "images"


def open_index(data_config, workdir: str, show: bool, names: list[str] | None = None
               ) -> tuple[list[str], dict[str, FileSplit]]:
    """(class names, {'train', 'test': FileSplit}) of the folder `config.data.source`: indexed into
    WORKDIR/images/ the first time, read back after (a resumed run sees the files it was started on);
    `names`: the run's class names by id, where it has them."""
    root = os.path.abspath(os.path.expanduser(data_config.source))
    out = os.path.join(workdir, INDEX_DIR)
    record_path = os.path.join(out, "index.json")
    wanted = {"source": root, "val_labels": data_config.val_labels, "test_fraction": data_config.test_fraction,
              "names": names}
    record = json.load(open(record_path)) if os.path.exists(record_path) else {}
    if record and record.get("names") is None and names == record.get("classes"):
        wanted["names"] = None  # the index's own classes ask for no other ids
    if {k: record.get(k) for k in wanted} != wanted:
        classes, splits = index_folder(root, data_config.test_fraction, data_config.val_labels, show, names)
        os.makedirs(out, exist_ok=True)
        for name, (paths, labels) in splits.items():
            _save(os.path.join(out, f"{name}_paths.npy"), np.array(paths, dtype=np.bytes_))
            _save(os.path.join(out, f"{name}_labels.npy"), np.array(labels, np.int64))
        record = wanted | {"classes": classes, "counts": {s: len(p) for s, (p, _) in splits.items()}}
        save_json(record_path, record)
        if show:
            print(f"images: indexed {root}: {len(classes)} classes, " + ", ".join(
                f"{n:,} {s}" for s, n in record["counts"].items()) + f" -> {out}", file=sys.stderr)
    return record["classes"], {s: FileSplit(root, os.path.join(out, f"{s}_paths.npy"),
                                            os.path.join(out, f"{s}_labels.npy")) for s in ("train", "test")}


def share_index(data_config, workdir: str, run_dirs: list[str], show: bool = False) -> None:
    """Indexes the folder `config.data.source` into WORKDIR/images (`open_index`) and hard-links that index
    into each of `run_dirs` (copies where a link cannot be made) that has none: a sweep's trials then read
    one index instead of each scanning the folder (ImageNet's 1.3 million files). The record goes in
    last, so an interrupted share leaves a run that indexes for itself."""
    open_index(data_config, workdir, show)
    source = os.path.join(workdir, INDEX_DIR)
    files = sorted(f for f in os.listdir(source) if f.endswith(".npy")) + ["index.json"]
    for run_dir in run_dirs:
        target = os.path.join(run_dir, INDEX_DIR)
        if os.path.exists(os.path.join(target, "index.json")):
            continue
        os.makedirs(target, exist_ok=True)
        for name in files:
            _link(os.path.join(source, name), os.path.join(target, name))


def _link(source: str, target: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(target)
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def _save(path: str, array: np.ndarray) -> None:
    with open(path + ".tmp", "wb") as f:
        np.save(f, array)
    os.replace(path + ".tmp", path)


def save_json(path: str, record: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=1)
    os.replace(path + ".tmp", path)


def is_folder_of_files(source: str) -> bool:
    path = os.path.expanduser(source)
    return os.path.isdir(path) and not glob.glob(os.path.join(path, "*-images-idx3-ubyte*"))
