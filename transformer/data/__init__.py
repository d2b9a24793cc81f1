"""Data: text/ (documents, tokenizers, token stores and their order, labelled text) and images/
(sources, folders, views on the host and the device, batches).

  text/           what flows to the language-model, seq2seq and classification tasks
  images/         what flows to the image-classification task
  spawn.py        worker processes that do not re-import the parent's __main__ (both sides use it)
  tokenize.py     the command `python -m transformer.data.tokenize`: build or inspect a token store
  prepare.py      the command `python -m transformer.data.prepare`: write the embedded text tasks
"""
