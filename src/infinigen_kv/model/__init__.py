"""The model side: our model classes (transformer.py, their config hparams.py, their operations ops.py, a forward's
shared inputs step.py), loading a checkpoint into them (load.py, weights.py, gguf.py, tokenizer.py), the facts the
caches read (arch.py), attention over a cache layer's view (attention.py) and the CPU kernels."""
