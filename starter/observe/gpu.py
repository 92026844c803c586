"""GPU usage of a `--gpus` job, for its report, through NVML.

nvidia-ml-py (`import pynvml`) is imported only for a job given GPUs.  Its
GPUs are the job's alone, so device-wide figures are the job's: a thread
samples utilisation and memory in use every SAMPLE_S while the job runs;
energy is the difference of the device's counter (millijoules since the
driver loaded) from start to end.  Nothing here fails a job: without the
module, without a driver or where a call fails, the report says
"gpu": null and "gpu_error" why.

    usage = Usage(spec.gpus)      # after the job started
    ...
    report.update(usage.stop())   # {"gpu": {...}} or {"gpu": None, "gpu_error": "..."}
"""

import time
from _thread import allocate_lock as _allocate_lock

SAMPLE_S = 1.0


class Usage:
    def __init__(self, gpus):
        self.error = None
        self.nvml = None
        self.devices = []        # [dict of figures], one per GPU, with its handle under "_h"
        self._stop = [False]
        self._done = _allocate_lock()
        try:
            import pynvml
        except ImportError:
            self.error = "nvidia-ml-py (pynvml) is not installed"
            return
        try:
            pynvml.nvmlInit()
        except Exception as e:      # noqa: BLE001 - NVMLError, or an OSError of the library
            self.error = f"NVML: {_words(e)}"
            return
        self.nvml = pynvml
        try:
            for index, uuid, _minor in gpus:
                h = (pynvml.nvmlDeviceGetHandleByUUID(uuid) if uuid else pynvml.nvmlDeviceGetHandleByIndex(index))
                d = {"index": index, "uuid": uuid or _try(pynvml.nvmlDeviceGetUUID, h),
                     "name": _try(pynvml.nvmlDeviceGetName, h), "_h": h, "_util": [],
                     "memory_peak_bytes": None,
                     "_energy0": _try(pynvml.nvmlDeviceGetTotalEnergyConsumption, h)}
                self.devices.append(d)
        except Exception as e:      # noqa: BLE001
            self.error = f"NVML: {_words(e)}"
            self._shutdown()
            return
        self._sample()
        import _thread

        self._done.acquire()
        try:
            _thread.start_new_thread(self._run, ())
        except RuntimeError:
            self._done.release()

    def _run(self):
        try:
            while not self._stop[0]:
                time.sleep(SAMPLE_S)
                if not self._stop[0]:
                    self._sample()
        finally:
            self._done.release()

    def _sample(self):
        n = self.nvml
        for d in self.devices:
            u = _try(n.nvmlDeviceGetUtilizationRates, d["_h"])
            if u is not None:
                d["_util"].append(u.gpu)
            m = _try(n.nvmlDeviceGetMemoryInfo, d["_h"])
            if m is not None and (d["memory_peak_bytes"] is None or m.used > d["memory_peak_bytes"]):
                d["memory_peak_bytes"] = int(m.used)

    def stop(self):
        """End the sampling -> what the report gets."""
        if self.error is not None:
            return {"gpu": None, "gpu_error": self.error}
        self._stop[0] = True
        with self._done:        # the thread's last sample is over
            pass
        self._sample()
        out = []
        for d in self.devices:
            e1 = _try(self.nvml.nvmlDeviceGetTotalEnergyConsumption, d["_h"])
            util = d["_util"]
            out.append({"index": d["index"], "uuid": _text(d["uuid"]), "name": _text(d["name"]),
                        "utilization_percent": round(sum(util) / len(util), 1) if util else None,
                        "utilization_max_percent": max(util) if util else None,
                        "memory_peak_bytes": d["memory_peak_bytes"],
                        "energy_j": (round((e1 - d["_energy0"]) / 1000.0, 3)
                                     if e1 is not None and d["_energy0"] is not None else None),
                        "samples": len(util)})
        self._shutdown()
        return {"gpu": {"devices": out, "sample_s": SAMPLE_S}}

    def _shutdown(self):
        try:
            self.nvml.nvmlShutdown()
        except Exception:      # noqa: BLE001
            pass


def _try(fn, *args):
    try:
        return fn(*args)
    except Exception:       # noqa: BLE001 - a figure the GPU does not support is None
        return None


def _text(v):
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else v


def _words(e):
    return " ".join(str(e).split())[:200] or type(e).__name__
