"""Text: where documents come from, how they become ids, and the examples the tasks read.

  sources.py                  documents of a corpus (stdlib, globs, JSON lines, Parquet, datasets
                              directories), their segments and the train/eval split
  tokenizers.py               the Tokenizer protocol; byte, BPE, WordPiece, GPT-2, Hugging Face
                              tokenizers; a run's tokenizer saved, loaded and checked
  sentencepiece_tokenizer.py  a sentencepiece model (T5's spiece.model) as a Tokenizer
  token_store.py              the token store: its format, shard writing and memory-mapped reading
  store_encoding.py           a store's end-of-document id, and encoders of many documents at once
  store_build.py              building a store in parallel (the library of `python -m transformer.data.tokenize`)
  order.py                    the order of examples: a Feistel permutation per epoch, weighted mixtures
  lm_streams.py               a run's stores cut into windows, in order: the language-model tasks' tokens
  seq2seq_pairs.py            `source<TAB>target` pairs, and the embedded code -> docstring task
  labelled.py                 `label<TAB>text` and CoNLL token tags, and the embedded package and
                              token-type tasks
  chat_templates.py           chat rendering: conversations -> ids and the assistant mask (a Jinja
                              chat_template, or the built-in one whose markers are added special tokens)
"""
