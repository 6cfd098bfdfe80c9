"""The KV-cache methods, one module each, made by name through registry.py; base.py is the contract they share.

  base.py       LogicalLayer (a layer's traits) and Rebatch (continuous batching, forks)
  registry.py   name -> factory, options, traits; make_cache
  rows.py       RowBuffer: per-(sequence, head) rows, the storage behind every cache here
  keep.py       which past positions a decode token may attend (padding, masks, windows)
  budget.py     how many entries a budget keeps or fetches
  infinigen/    InfiniGen (its own map in its __init__)
  full.py offload.py quant.py streaming.py h2o.py evicting.py hf.py: the baselines
"""
