"""A trained run used as a function: what a run computes once it is trained, for commands and for Python.

  decoding.py     the key/value cache, sampling and greedy decoding of a GPT, greedy and beam search of an
                  encoder-decoder (`python -m transformer.generate`)
  classifier.py   a trained classifier (BERT sequence and token, ViT images) as a function of raw inputs
                  (`python -m transformer.predict`)

Scoring (log-likelihoods of continuations), chat rendering, the harness model, the HTTP app and rollouts
belong here too. This room reads a run through `transformer.rundir` and builds on models/ and data/; it never
imports training/, and nothing in rundir, layers/, models/ or data/ imports it.
"""
