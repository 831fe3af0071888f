"""GPU energy of a timed stretch, for `lucebox bench speed`'s joules per token.

A background thread samples the board power through NVML (the `nvidia-ml-py` package, `import pynvml`;
the `bench` extra) every INTERVAL_S; `joules(t0, t1)` integrates the samples between two perf_counter
stamps (trapezoids, the ends interpolated), so one sampler serves every timed run of a phase. Where the
driver keeps the board's energy counter (Volta and later) its difference over the same stretch is
reported too, as a check on the sampling. Without NVML (no package, no NVIDIA GPU, CPU runs) the meter
is None and the report says "n/a (no NVML)".
"""
from __future__ import annotations

import bisect
import itertools
import threading
import time

INTERVAL_S = 0.02


def integrate(samples: list[tuple[float, float]], t0: float, t1: float) -> float:
    """Integral of power (watts) over [t0, t1] from (time, watts) samples sorted by time: trapezoids
    between samples, linear interpolation at t0 and t1, the nearest sample's value beyond the ends."""
    if t1 < t0:
        raise ValueError(f"integrate: the stretch ends ({t1}) before it starts ({t0})")
    if not samples:
        raise ValueError("integrate: no power samples")
    times = [t for t, _ in samples]

    def power_at(t: float) -> float:
        i = bisect.bisect_left(times, t)
        if i == 0:
            return samples[0][1]
        if i == len(samples):
            return samples[-1][1]
        (ta, pa), (tb, pb) = samples[i - 1], samples[i]
        return pa + (pb - pa) * (t - ta) / (tb - ta)
    inside = [(t, p) for t, p in samples if t0 < t < t1]
    points = [(t0, power_at(t0)), *inside, (t1, power_at(t1))]
    return sum((tb - ta) * (pa + pb) / 2 for (ta, pa), (tb, pb) in itertools.pairwise(points))


class PowerMeter:
    """NVML power samples of one GPU in a daemon thread; `joules(t0, t1)` over any stretch while it runs."""

    def __init__(self, nvml, handle, interval: float = INTERVAL_S):
        self.nvml, self.handle, self.interval = nvml, handle, interval
        self.samples: list[tuple[float, float]] = []
        self.counter: list[tuple[float, float]] = []  # (time, joules since the driver loaded), where kept
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-power", daemon=True)

    def _read(self) -> None:
        now = time.perf_counter()
        self.samples.append((now, self.nvml.nvmlDeviceGetPowerUsage(self.handle) / 1e3))  # milliwatts
        try:
            self.counter.append((now, self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) / 1e3))  # mJ
        except self.nvml.NVMLError:
            pass

    def _run(self) -> None:
        while not self._stop.is_set():
            self._read()
            self._stop.wait(self.interval)

    def __enter__(self) -> PowerMeter:
        self._read()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._read()

    def joules(self, t0: float, t1: float) -> dict:
        """Energy over [t0, t1]: integrated samples, the counter's difference (None where not kept), the
        number of samples inside the stretch."""
        counted = None
        if len(self.counter) >= 2:
            before = [j for t, j in self.counter if t <= t0]
            after = [j for t, j in self.counter if t >= t1]
            counted = after[0] - before[-1] if before and after else None
        return {"joules": integrate(list(self.samples), t0, t1), "counter_joules": counted,
                "samples": sum(t0 <= t <= t1 for t, _ in self.samples)}


def open_meter(device) -> tuple[PowerMeter | None, str | None]:
    """(a meter of this torch device's GPU, None) or (None, why there is none)."""
    if device.type != "cuda":
        return None, "n/a (no NVML): not a CUDA device"
    try:
        import pynvml
    except ImportError:
        return None, "n/a (no NVML): the nvidia-ml-py package is not installed (pip install lucebox[bench])"
    try:
        import torch
        pynvml.nvmlInit()
        uuid = str(getattr(torch.cuda.get_device_properties(device), "uuid", ""))
        handle = (pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}") if uuid
                  else pynvml.nvmlDeviceGetHandleByIndex(device.index or 0))
        pynvml.nvmlDeviceGetPowerUsage(handle)
    except Exception as e:  # noqa: BLE001 - any NVML failure means no energy figure, never a failed bench
        return None, f"n/a (no NVML): {e}"
    return PowerMeter(pynvml, handle), None
