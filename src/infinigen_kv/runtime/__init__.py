"""Running a model with any cache: prefill and the decode loop (generation.py), continuous batching
(batching.py), sampling (sampling.py) and the CPU thread count of decode steps (threads.py)."""
