"""Run studies/accuracy_smollm2.py's main() unchanged, but also save per-sequence numbers.

Usage (under the launcher, like the study itself):

    python tools/launch.py -n 2 studies/paired/persq.py --npz OUT.npz [--perturb EPS --perturb-seed S] \
        <accuracy_smollm2.py args...>

Hooks (monkeypatches, no file of the study is changed):
* ``Model.score``: the first call is the unsplit reference; its (nll, top) are kept.
* ``evaluate``: each method's (nll, top), keyed by the reducer's name, are kept.
* with ``--perturb EPS`` (a null control): every echonccl reducer multiplies its float32 partial
  sum by (1 + EPS * N(0, 1)) (numpy Generator(seed + 1000 * rank), fresh per reducer) before
  the cast to the all-reduce dtype. Irrelevant in expectation; it only re-rolls which
  quantization decisions happen, as the bf16 rounding of a residual does.
Rank 0 writes OUT.npz: nll_ref, top_ref (B, T-1), and per method nll__NAME, top__NAME.
"""
from __future__ import annotations

import sys
from pathlib import Path

STUDIES = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(STUDIES))


def main() -> int:
    argv = sys.argv[1:]

    def pop(flag, default=None):
        if flag in argv:
            i = argv.index(flag)
            v = argv[i + 1]
            del argv[i:i + 2]
            return v
        return default

    npz = pop("--npz")
    eps = float(pop("--perturb", "0"))
    seed = int(pop("--perturb-seed", "0"))

    import numpy as np
    import accuracy_smollm2 as st
    import reducers

    saved = {}
    orig_score = st.Model.score

    def score(self, mpi, h, toks):
        out = orig_score(self, mpi, h, toks)
        if "nll_ref" not in saved:
            saved["nll_ref"], saved["top_ref"] = out
        return out

    st.Model.score = score

    orig_eval = st.evaluate

    def evaluate(a, mpi, model, toks, red, h_ref, ref_streams):
        out = orig_eval(a, mpi, model, toks, red, h_ref, ref_streams)
        name = getattr(red, "name", type(red).__name__)
        saved["nll__" + name], saved["top__" + name] = out[0], out[1]
        return out

    st.evaluate = evaluate

    if eps:
        from mpi4py import MPI
        rank = MPI.COMM_WORLD.Get_rank()
        orig_init, orig_call = reducers.Echo.__init__, reducers.Echo.__call__

        def init(self, *a, **k):
            orig_init(self, *a, **k)
            self._rng = np.random.Generator(np.random.PCG64(seed + 1000 * rank))

        def call(self, x):
            x = np.asarray(x, np.float32)
            x = (x * (1 + eps * self._rng.standard_normal(x.shape))).astype(np.float32)
            return orig_call(self, x)

        reducers.Echo.__init__, reducers.Echo.__call__ = init, call

    rc = st.main(argv)
    from mpi4py import MPI
    if npz and MPI.COMM_WORLD.Get_rank() == 0:
        np.savez_compressed(npz, perturb=eps, perturb_seed=seed, argv=np.array(argv), **saved)
    return rc


if __name__ == "__main__":
    sys.exit(main())
