"""tools/stall_profile.py's offline side, on the CPU: an nvdisasm listing cut into its kernels'
functions, a dump's samples by function (a fused kernel's phases), the shares left without the
``*_not_issued`` counters. The sampling itself needs CUPTI on a GPU (BENCHMARKS.md, the tools)."""
from __future__ import annotations

import json

import numpy as np
import pytest

import stall_profile as sp

SASS = """
	.section	.text.k_two,"ax",@progbits
.text.k_two:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
.L_x_3:
        /*0020*/                   CALL.REL.NOINC `($k_two$_ZN4echo12phase_decodeEv) ;
        /*0030*/                   EXIT ;
$k_two$_ZN4echo12phase_decodeEv:
        /*0040*/                   LDG.E R2, desc[UR4][R2.64] ;
        /*0050*/                   LOP3.LUT R3, R2, 0xf, RZ, 0xc0, !PT ;
$__internal_0_$__cuda_sm20_div_s64:
        /*0060*/                   IADD3 R4, R4, 0x1, RZ ;
        /*0070*/                   RET.REL.NODEC R20 `(k_two) ;
.text.k_one:
        /*0000*/                   EXIT ;
"""


def test_sass_functions_cuts_each_kernel_at_its_labels():
    f = sp.sass_functions(SASS)
    assert f == {"k_two": [(0x0, "entry"), (0x40, "_ZN4echo12phase_decodeEv"),
                           (0x60, "__internal_0_$__cuda_sm20_div_s64")],
                 "k_one": [(0x0, "entry")]}
    funcs = f["k_two"]
    assert [sp.function_at(funcs, o) for o in (0x0, 0x30, 0x40, 0x50, 0x60, 0x70)] == \
        ["entry", "entry", "_ZN4echo12phase_decodeEv", "_ZN4echo12phase_decodeEv",
         "__internal_0_$__cuda_sm20_div_s64", "__internal_0_$__cuda_sm20_div_s64"]


def _dump():
    reasons = ["selected", "barrier", "long_scoreboard", "long_scoreboard_not_issued"]
    case = {"name": "P=2 1 GiB whole from all", "funcs": ["k_two", "k_two", "k_two", "k_other"],
            "offsets": [0x10, 0x50, 0x40, 0x0],
            "counts": [[0, 6, 0, 0], [1, 0, 8, 5], [1, 0, 2, 2], [2, 0, 0, 0]], "totals": [0, 0, 0, 0]}
    return {"reasons": reasons, "cases": [case]}


def test_by_function_counts_each_sample_once():
    d = _dump()
    rows = sp.by_function(d["cases"][0], d["reasons"], sp.sass_functions(SASS))
    assert rows == [("_ZN4echo12phase_decodeEv", 12, {"selected": 2, "long_scoreboard": 10}),
                    ("entry", 6, {"barrier": 6}), ("k_other", 2, {"selected": 2})]
    assert sp.sampled(d["reasons"]).tolist() == [True, True, True, False]


def test_annotate_prints_the_shares_by_function(tmp_path, capsys):
    (tmp_path / "d.json").write_text(json.dumps(_dump()))
    (tmp_path / "k.sass").write_text(SASS)
    assert sp.main(["--annotate", str(tmp_path / "d.json"), "--sass", str(tmp_path / "k.sass")]) == 0
    out = capsys.readouterr().out
    assert "## P=2 1 GiB whole from all: 20 samples" in out
    assert "| entry | 30.0 | barrier 100 |" in out
    assert "| 60.0 | long_scoreboard 83, selected 17 |" in out      # phase_decode, by any name
    with pytest.raises(SystemExit):
        sp.main(["--annotate", str(tmp_path / "d.json")])          # no listing
    with pytest.raises(SystemExit):
        sp.main([])                                                # sampling needs --lib, --cupti


def test_report_leaves_the_not_issued_counters_out(capsys):
    reasons = ["selected", "long_scoreboard", "long_scoreboard_not_issued", "wait", "barrier"]
    counts = np.array([[3, 1, 1, 0, 0], [0, 4, 4, 0, 0]], np.uint32)   # (unsigned: their top, not the zeros)
    got = sp.report("c", reasons, ["k", "k"], np.array([0x10, 0x20], np.uint64), counts, np.zeros(4), top=2)
    out = capsys.readouterr().out
    assert "## c: 8 samples in 2 PCs" in out
    assert "| long_scoreboard | 62.5 |" in out and "not_issued |" not in out
    assert "k 0x0020: 50.0%  (long_scoreboard 50.0)" in out
    assert "k 0x0010: 50.0%  (selected 37.5, long_scoreboard 12.5)" in out
    assert got["counts"] == counts.tolist() and got["offsets"] == [16, 32]
