"""Settings that give the same floating-point results on every x86 machine, for the test suite and the
learning-spread bench. Imports nothing heavy: they must be in the environment before torch loads.

ATen, MKL and oneDNN otherwise pick AVX-512 kernels on CPUs that have them; those round differently, and
an RL run amplifies a last-bit difference into another trajectory, so a learning test's threshold measured
on one machine would not hold on another. One thread too, since the number of threads changes how sums
are split. Subprocesses (Ray workers, vLLM) inherit the environment.
"""

from __future__ import annotations

import os
import platform

DETERMINISTIC_CPU = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
if platform.machine() in ("x86_64", "AMD64"):
    DETERMINISTIC_CPU |= {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def pin_environment() -> None:
    """Put the settings into this process's environment, where nobody set them already."""
    for name, value in DETERMINISTIC_CPU.items():
        os.environ.setdefault(name, value)
