"""One GPU: tools/fused_solo.py, rank 0 of a P-rank fused all-reduce alone on the GPU against
peer buffers filled as its peers leave them, finishes at P = 2 and 4 without a wait timing out,
with finite times, and its first call equals the P-rank reference all-reduce bit for bit (the
`_whole` kernels where slices are whole, the two-shot's any-count twin where not; else the
general ones). The host side: tests/test_fused_solo.py."""
import math

import pytest

from conftest import needs_gpus

pytestmark = needs_gpus(1)

WHOLE, RAGGED = 1 << 20, 1_000_000         # bytes of bf16 input: 2^19 elements, and 500000


@pytest.mark.parametrize("cd", ["int4-h32", "int4-h32/int7-h32"])
def test_solo_rank_finishes_alone_and_matches_the_reference(cd):
    import fused_solo

    res = fused_solo.run_solo([2, 4], [WHOLE, RAGGED], codec_name=cd, iters=3, reps=2, timeout=5.0)
    assert sorted(res) == [(P, b) for P in (2, 4) for b in sorted((WHOLE, RAGGED))]
    for (P, nbytes), cases in res.items():
        for kn, c in cases.items():
            what = f"P={P} {nbytes} bytes {kn}"
            assert c.fits, what
            assert c.check == "ok", f"{what}: {c.check}"
            assert len(c.times) == 2 and all(math.isfinite(t) and t > 0 for t in c.times), f"{what}: {c.times}"
            assert c.whole == (kn == "whole" or (kn == "q_whole" and nbytes == WHOLE)), what
            assert c.any_count == (kn == "whole" and nbytes != WHOLE), what


@pytest.mark.parametrize("argv", [["--ranks", "2", "--sizes", "4M", "--iters", "3", "--reps", "1"],
                                  ["--solo", "--ranks", "4", "--sizes", "4M", "--kernels", "whole", "q_whole",
                                   "--iters", "3", "--reps", "1", "--rounding", "off"]])
def test_solo_table(argv, capsys):
    """The command line (fused_solo.py, and fused_bench.py --solo): a table, exit status 0."""
    if argv[0] == "--solo":
        import fused_bench

        with pytest.raises(SystemExit) as exc:
            fused_bench.main(argv)
        assert exc.value.code == 0
    else:
        import fused_solo

        assert fused_solo.main(argv) == 0
    text = capsys.readouterr().out
    assert "| 4 MiB |" in text and "bit for bit, every case" in text, text
