"""Variants of the GPU decode step against each other in one process, on the Llama-3.1-8B-shaped model of
scripts/gpu_check.py (random bf16 weights): InfiniGen at budget 0.1, replayed as a CUDA graph, median step time by CUDA
events, for each variant of

  gather   the row gather's share of the SMs (gather_rows_triton.SM_SHARE; "all": a program per 16 rows)
  scores   the speculation's float32 product: "qk" (q @ k^T with the mask in its op) or "kq" (k @ q^T, the mask added
           after: cuBLAS sees n as its long dimension)

    python scripts/dev/gpu_ab.py [--context 32768] [--batch 1] [--gather all,0.5,0.25] [--scores qk,kq] [--new 24]

Prints one line per variant (and full's step for reference). Needs a CUDA GPU.
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gpu_check  # noqa: E402

import infinigen_kv as ig  # noqa: E402
from infinigen_kv.methods.infinigen import gather_rows_triton, speculator  # noqa: E402
from infinigen_kv.runtime.generation import generate  # noqa: E402

QK = speculator.approx_scores


def kq_scores(q_partial, k_partial, scale, bias=None):
    if k_partial.dtype == torch.int8 or bias is None:
        return QK(q_partial, k_partial, scale, bias)
    B, G, r, p = q_partial.shape
    q = q_partial.float() * scale if scale != 1.0 else q_partial.float()
    s = torch.bmm(k_partial.float().reshape(B * G, -1, p), q.reshape(B * G, r, p).transpose(1, 2))  # (BG, n, r)
    return (s.transpose(1, 2) + bias).view(B, G, r, -1)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--gather", default="all,0.5,0.25")
    ap.add_argument("--scores", default="qk,kq")
    ap.add_argument("--new", type=int, default=24)
    a = ap.parse_args()
    c = gpu_check.Check(torch.device("cuda"), False, Path("/tmp"))
    with torch.inference_mode():
        model = gpu_check.big_model(c)
        cal = c.work / "cal.safetensors"
        ig.calibrate(model, tokens=1024).save(cal)
        ids = torch.randint(10, model.config.vocab_size, (a.batch, a.context),
                            generator=torch.Generator().manual_seed(0)).cuda()

        def step_ms(method, **opts):
            timer = gpu_check.StepTimer(True)
            generate(model, ids, cache=ig.make_cache(method, model, **opts), max_new_tokens=a.new,
                     stop_at_eos=False, on_step=timer)
            return statistics.median(timer.steps_ms()[2:])

        print(f"B{a.batch} x {a.context}: full {step_ms('full'):.2f} ms", flush=True)
        for scores in a.scores.split(","):
            speculator.approx_scores = QK if scores == "qk" else kq_scores
            for share in a.gather.split(","):
                gather_rows_triton.SM_SHARE = 1e9 if share == "all" else float(share)
                gather_rows_triton._programs.cache_clear()
                ms = step_ms("infinigen", budget=0.1, calibration=str(cal))
                print(f"  infinigen-0.1 scores={scores} gather={share}: {ms:.2f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
