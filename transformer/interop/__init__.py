"""Hugging Face checkpoints in and out: hf.py (read a directory a tensor at a time, write one back),
hf_families.py (per-architecture config keys and weight layouts: GPT-2, BERT, ViT, BART), hf_decoders.py
(Llama, Mistral, Qwen2, Qwen3), hf_bloom.py (BLOOM), hf_t5.py (T5), hf_marian.py (Marian),
hf_ijepa.py (I-JEPA: the ViT of mean pooling), hf_inputs.py (the tokenizer's and
image processor's files written beside a model), hf_import.py (a model directory into a run directory, and the
commands it runs next), hf_export.py (a run directory out), hf_peft.py (LoRA adapters out and in as PEFT adapters)."""
