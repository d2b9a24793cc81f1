"""A trained run used as a function: what a run computes once it is trained, for commands and for Python.

  sampling.py     the sampling record (temperature, top_k, top_p, seed, max tokens, stop ids and strings), its
                  one check, the per-row sampler
  decoding.py     the key/value cache and the cached decode step of a GPT; greedy and beam search of an
                  encoder-decoder (`python -m transformer.generate`)
  engine.py       the one decoder of every causal caller: fixed cache slots, continuous batching, a shared
                  prompt prefilled once, per-row sampling and stops (generate, chat, serve, harness, rollouts)
  hosts.py        decoding on several processes: each a replica of the params decoding its share, answers shared
  classifier.py   a trained classifier (BERT sequence and token, ViT images) as a function of raw inputs
                  (`python -m transformer.predict`)
  scoring.py      log-likelihoods of continuations (with greedy flags), rolling log-likelihoods of documents and
                  generation until stop strings, in a few fixed shape buckets over the run's mesh
  harness.py      the lm-evaluation-harness model of a run (`python -m transformer.evaluate --tasks`)
  images.py       ImageGPT's completions: the upper half of each image kept, the rest sampled, a grid PNG
  rollouts.py     completions sampled G at a time for reinforcement learning, a function of (seed, step), with
                  the sampler's own log-probs
  chat.py         a conversation through the engine (`python -m transformer.chat`)
  server.py       the OpenAI-compatible HTTP app (`python -m transformer.serve`): its guard, limits and routes
  protocol.py     what a request to it may hold (each field in its range), and how a token is written in logprobs

This room reads a run through `transformer.rundir` and builds on models/ and data/; it never imports training/,
and nothing in rundir, layers/, models/ or data/ imports it. Chat templates (conversations -> ids and the
assistant mask) are tokenization: `transformer.data.text.chat_templates`.
"""
