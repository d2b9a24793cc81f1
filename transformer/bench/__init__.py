"""The measuring wing: benchmarks of this library, which nothing outside this package imports
(tests/test_wing.py checks it). Training runs never need it.

  __main__.py      `python -m transformer.bench --config ...`: flags and main
  measure.py       what the bench times: our train step (items/s, compile, memory, MFU), the loader
                   alone, greedy generation; `Ours`, the train step as a run compiles it
  census.py        the op census of a compiled program (the bench prints its train step's)
  attention.py     `python -m transformer.bench.attention`: every attention implementation x mask,
                   forward and backward, timed, with its error against the dense reference
  the PyTorch peer (`--vs hf|torch`: the same model in PyTorch, in a process of its own)
    peer.py          parent side, in the bench's process: starts the child, feeds it, reads its answers
    peer_process.py  child side, in the spawned process: `serve`s the parent's calls, `Theirs` trains
    torch_models.py  child side: the PyTorch models the peer can be (transformers' GPT-2, torch_gpt.py)
    torch_gpt.py     child side: the nanoGPT-style GPT in PyTorch, with its static-cache decoder

The GPU suite, which runs these commands row by row against targets, is experiments/bench/gpu_suite.py.
"""
