"""Spike (issue 12): can NVRTC, through CuPy, compile a kernel against the NCCL device API
(``nccl_device.h``) of the NCCL wheel found at run time? Prints one line per step; exit 0.

    python3 tools/nccl_device_api_spike.py
"""
import glob
import os
import sys
import time

import cupy

SRC = r'''
#include <nccl_device.h>
extern "C" __global__ void lsa_probe(ncclWindow_t win, size_t offset, int peer, void** out) {
    *out = ncclGetLsaPointer(win, offset, peer);
}
'''


def main() -> int:
    incs = sorted({os.path.dirname(p) for p in glob.glob(os.path.join(sys.prefix, "lib", "python3*", "site-packages",
                                                                       "nvidia", "nccl*", "include", "nccl_device.h"))}
                  | {os.path.dirname(p) for p in glob.glob("/usr/include/nccl_device.h")})
    print(f"spike: nccl_device.h found in {incs or 'nowhere'}")
    for inc in incs:
        t0 = time.time()
        try:
            mod = cupy.RawModule(code=SRC, options=("--std=c++17", f"-I{inc}", "-I/usr/local/cuda/include"))
            mod.get_function("lsa_probe")
            print(f"spike: NVRTC compiled ncclGetLsaPointer against {inc} in {time.time() - t0:.1f} s")
        except Exception as exc:  # the spike reports, it does not decide
            print(f"spike: NVRTC failed against {inc}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
