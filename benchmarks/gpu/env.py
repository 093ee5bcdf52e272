"""Step 1: the environment: jax, jaxlib, CUDA and cuDNN versions, `nvidia-smi`, and the exact text of any
deprecation warning JAX gives while our kernels are imported, lowered and compiled (JAX 0.11 deprecates
the Pallas Triton backend they use)."""

from __future__ import annotations

import logging
import subprocess
import warnings

from benchmarks.gpu.step import Step, error_text

SMI_FIELDS = ("name,driver_version,memory.total,memory.used,utilization.gpu,temperature.gpu,clocks.sm,"
              "clocks.max.sm,clocks.mem,power.draw,power.limit")
CUDA_VERSION_FUNCTIONS = ("cuda_runtime_get_version", "cuda_driver_get_version", "cudnn_get_version",
                          "cublas_get_version", "cuda_compute_capability")


def library_versions() -> dict:
    """jax, jaxlib and, where the CUDA plugin is installed, the CUDA/cuDNN versions it reports."""
    import jax
    import jaxlib

    versions = {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "backend": jax.default_backend(),
                "devices": [str(d) for d in jax.devices()], "device_kind": jax.devices()[0].device_kind}
    try:
        from jax._src.lib import cuda_versions
    except Exception as exc:  # noqa: BLE001 - a private module: report, never fail on it
        versions["cuda_versions"] = f"unavailable ({error_text(exc)})"
        return versions
    if cuda_versions is None:
        versions["cuda_versions"] = "unavailable (no CUDA plugin)"
        return versions
    for name in CUDA_VERSION_FUNCTIONS:
        function = getattr(cuda_versions, name, None)
        try:
            versions[name] = function() if name != "cuda_compute_capability" else function(0)
        except Exception as exc:  # noqa: BLE001 - absent or failing: say so
            versions[name] = f"unavailable ({error_text(exc, 80)})"
    return versions


def nvidia_smi() -> str:
    """`nvidia-smi -L` and a CSV query of the GPU's state, or why they did not run."""
    lines = []
    for command in (["nvidia-smi", "-L"], ["nvidia-smi", "--format=csv", f"--query-gpu={SMI_FIELDS}"]):
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=30)
            lines.append((done.stdout + done.stderr).strip() or f"{command[0]}: exit {done.returncode}, no output")
        except (OSError, subprocess.TimeoutExpired) as exc:
            lines.append(f"{' '.join(command)}: {error_text(exc)}")
    return "\n".join(lines)


def lower_one_kernel(compile_it: bool) -> str:
    """Import the kernels, lower the decode kernel for CUDA at a small shape and, on a GPU, compile it."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.paged_decode_attention.kernel import paged_decode_attention

    q = jax.ShapeDtypeStruct((4, 32, 128), jnp.bfloat16)  # (R, Hq, D)
    cache = jax.ShapeDtypeStruct((1, 64, 16, 8, 128), jnp.bfloat16)  # (L, P, S, Hkv, D)
    lens = jax.ShapeDtypeStruct((4,), jnp.int32)  # (R,)
    table = jax.ShapeDtypeStruct((4, 8), jnp.int32)  # (R, W)

    def attend(q, k, v, lens, table):
        return paged_decode_attention(q, k, v, 0, lens, table, sm_scale=0.125)  # (R, Hq, D)

    traced = jax.jit(attend).trace(q, cache, cache, lens, table)
    if compile_it:
        traced.lower().compile()
        return "lowered and compiled paged_decode_attention for this GPU"
    traced.lower(lowering_platforms=("cuda",))
    return "lowered paged_decode_attention for cuda (no GPU here: not compiled)"


class _Records(logging.Handler):
    """Keeps every log record at WARNING or above."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def deprecation_warnings(on_gpu: bool) -> dict:
    """Every Python warning and warning-level log record raised while importing, lowering and compiling a
    kernel, as text; plus JAX's registered state of the `jax-pallas-triton` deprecation, where it has one."""
    handler = _Records()
    logging.getLogger().addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                outcome = lower_one_kernel(compile_it=on_gpu)
            except Exception as exc:  # noqa: BLE001 - the warnings seen until it failed still count
                outcome = f"FAIL {error_text(exc)}"
    finally:
        logging.getLogger().removeHandler(handler)
    found = [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught]
    found += [f"log {r.levelname} {r.name}: {r.getMessage()}" for r in handler.records]
    return {"outcome": outcome, "warnings": found, "triton_deprecation_state": triton_deprecation_state()}


def triton_deprecation_state() -> str:
    """Whether JAX registers the `jax-pallas-triton` deprecation and if it is accelerated (an error)."""
    try:
        from jax._src import deprecations
    except Exception as exc:  # noqa: BLE001 - a private module
        return f"unknown ({error_text(exc, 80)})"
    registered = getattr(deprecations, "_registered_deprecations", None)
    if registered is None or "jax-pallas-triton" not in registered:
        return "jax-pallas-triton not registered"
    return f"jax-pallas-triton registered, accelerated (raises): {deprecations.is_accelerated('jax-pallas-triton')}"


def run(step: Step) -> dict:
    """Step 1: print and return the versions, the GPU's state and the deprecation text."""
    versions = library_versions()
    for key, value in versions.items():
        print(f"{key}: {value}")
    smi = nvidia_smi()
    print(smi)
    on_gpu = versions["backend"] == "gpu"
    deprecation = deprecation_warnings(on_gpu)
    print(f"kernel: {deprecation['outcome']}")
    print(f"deprecation state: {deprecation['triton_deprecation_state']}")
    for text in deprecation["warnings"]:
        print(f"WARNING TEXT: {text}")
    if not deprecation["warnings"]:
        print("no deprecation warning")
    cuda = ", ".join(f"{k.replace('_get_version', '')} {versions[k]}" for k in CUDA_VERSION_FUNCTIONS[:3]
                     if k in versions)
    summary = (f"jax {versions['jax']}, jaxlib {versions['jaxlib']}, {versions['backend']}"
               f"{'; ' + cuda if cuda else ''}; {len(deprecation['warnings'])} warning(s)")
    return {"ok": not deprecation["outcome"].startswith("FAIL"), "summary": summary, "versions": versions,
            "nvidia_smi": smi, **deprecation}
