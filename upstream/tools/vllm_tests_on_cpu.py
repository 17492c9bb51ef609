"""A pytest plugin (``-p vllm_tests_on_cpu``) that lets vLLM 0.34's scheduler unit tests
run on a machine without an accelerator.

vLLM's test helpers build a ``VllmConfig`` whose ``DeviceConfig`` is ``"auto"``: without
a GPU the accelerator wheel cannot infer a device, and vLLM 0.34's CPU platform refuses
x86 without triton-cpu. The scheduler never touches the device, so an ``"auto"`` device
is taken as ``"cuda"``, as the project's own harness builds its configs. Nothing else
changes.
"""

from vllm.config import device

_post_init = device.DeviceConfig.__post_init__


def __post_init__(self: device.DeviceConfig) -> None:
    if self.device == "auto":
        self.device = "cuda"
    _post_init(self)


device.DeviceConfig.__post_init__ = __post_init__  # type: ignore[method-assign]
