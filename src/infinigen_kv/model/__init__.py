"""The model side: loading one (load.py), what differs between architectures (arch.py), what is installed on a
model (install.py: the attention function of attention.py, hooks, fast CPU linears) and the CPU kernels."""
