"""tools/timeline.py's accounting of kernel records (the CUPTI part needs a GPU machine)."""
import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("timeline", Path(__file__).parents[1] / "tools" / "timeline.py")
timeline = importlib.util.module_from_spec(spec)
spec.loader.exec_module(timeline)


def test_summary_counts_busy_time_and_overlap():
    recs = [  # (start_ns, end_ns, stream, name)
        (0, 10_000, 7, "echo_reduce_quantize"),
        (5_000, 30_000, 9, "ncclDevKernel_AllGather"),
        (8_000, 12_000, 7, "echo_dequantize"),          # overlaps the first codec kernel
        (40_000, 50_000, 9, "ncclDevKernel_AllGather"),
        (45_000, 60_000, 7, "echo_reduce_quantize"),
    ]
    span, nccl, other, both = timeline.summary(recs)
    assert span == 60.0
    assert nccl == 35.0                 # 25 + 10 us
    assert other == 27.0                # [0, 12] and [45, 60]
    assert both == 7.0 + 5.0            # [5, 12] and [45, 50]


def test_summary_without_nccl_kernels():
    assert timeline.summary([(0, 1_000, 1, "echo_x"), (2_000, 3_000, 1, "echo_y")]) == (3.0, 0.0, 2.0, 0.0)
