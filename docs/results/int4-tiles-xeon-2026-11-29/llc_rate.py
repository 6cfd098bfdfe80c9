# int4 linears (9,728 x 896, one row, two threads) over k distinct weights in turn: the rate while k weights fit
# the share of the L3 this VM gets, and once they do not. Usage: python llc_rate.py
import time, torch
from infinigen_kv.model import ops
torch.set_num_threads(2)
torch.manual_seed(0)
ws=[ops.held(torch.randn(9728,896)*0.02,"int4") for _ in range(40)]
x=torch.randn(1,896)
def run(lst, reps):
    ts=[]
    for _ in range(reps):
        t=time.perf_counter()
        for w in lst: ops.linear(x,w)
        ts.append((time.perf_counter()-t)/len(lst))
    ts.sort(); return ts[len(ts)//2]
by=ws[0].numel()
for k in (1, 2, 4, 8, 16, 20, 24, 28, 32, 40):
    m=run(ws[:k], max(4, 200//k))
    print(f"{k} distinct weights ({k*by/1e6:.0f} MB): {m*1e6:.0f} us each, {by/m/1e9:.1f} GB/s")
