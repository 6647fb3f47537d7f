"""``TorchModel.export``: the module as TorchScript (scripted, else traced) or ONNX, verified against the module
(see ``spark_hvd.estimators.common.export`` for the directory, the manifest and the checks every format shares)."""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from spark_hvd.estimators.common.export import (
    ExportError,
    check_format,
    compare,
    example_inputs,
    first_line,
    run_onnx,
    target,
    verify_inputs,
    write_manifest,
)

__all__ = ["TORCH_FORMATS", "export_torch"]

log = logging.getLogger(__name__)

TORCH_FORMATS = ("torchscript", "onnx")


def _torch_outputs(out: Any) -> list[np.ndarray]:
    import torch

    outs = [out] if isinstance(out, torch.Tensor) else list(out)
    return [o.detach().cpu().numpy() for o in outs]


def _torchscript(stage: Any, module: Any, tensors: tuple) -> Any:
    """``torch.jit.script`` (keeps control flow), else ``torch.jit.trace`` with a data-dependent branch (a
    ``TracerWarning``) as an :class:`ExportError` naming the module."""
    import torch

    with _jit_mode(module):
        try:
            return torch.jit.script(module)
        except Exception as exc:  # noqa: BLE001 - any scripting failure: a trace may still do
            log.info("export: torch.jit.script failed (%s); tracing instead", first_line(exc, 200))
    who = type(stage).__name__
    try:
        with warnings.catch_warnings(), _jit_mode(module):
            warnings.simplefilter("error", torch.jit.TracerWarning)
            with torch.no_grad():
                return torch.jit.trace(module, tensors, check_trace=False)
    except Exception as exc:  # noqa: BLE001
        warning = _in_chain(exc, torch.jit.TracerWarning)  # raised inside a C call: its SystemError's context
        if warning is not None:
            raise ExportError(f"{who}.export(format='torchscript'): module {_culprit(module, exc)} cannot be "
                              "traced: data-dependent control flow or a value read out of a tensor "
                              f"({first_line(warning)}); a trace would freeze the branch the example took") from exc
        raise ExportError(f"{who}.export(format='torchscript'): module {_culprit(module, exc)} can be neither "
                          f"scripted nor traced: {first_line(exc)}") from exc


class _jit_mode:  # noqa: N801 - a context manager used as a function
    """A LightningModule's ``_jit_is_scripting`` set while it is scripted or traced (as its own
    ``to_torchscript`` does: its ``trainer`` property and logging then stay quiet); a plain module: nothing."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.had = getattr(module, "_jit_is_scripting", None)

    def __enter__(self) -> None:
        if self.had is not None:
            self.module._jit_is_scripting = True

    def __exit__(self, *exc: Any) -> None:
        if self.had is not None:
            self.module._jit_is_scripting = self.had


def _onnx(stage: Any, module: Any, tensors: tuple, input_names: list[str], output_names: list[str],
          file: Path, opset: int | None) -> None:
    """``torch.onnx.export`` (the ``torch.export``-based exporter) with the batch dimension of every input open."""
    import torch

    who = type(stage).__name__
    try:
        import onnxscript  # noqa: F401 - the exporter needs it; say so before torch's own error does
    except ImportError as exc:
        raise ExportError(f"{who}.export(format='onnx') needs the packages onnx, onnxscript and onnxruntime: "
                          "pip install 'spark_hvd[export]'") from exc
    batch = torch.export.Dim("batch", min=1)
    dynamic = tuple({0: batch} for _ in tensors)
    kwargs: dict[str, Any] = {"input_names": input_names, "output_names": output_names,
                              "dynamic_shapes": dynamic, "dynamo": True, "verbose": False}
    if opset is not None:
        kwargs["opset_version"] = opset
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(module, tensors, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the exporter's errors are many types; all mean "cannot export"
        reason = first_line(exc)
        hint = ""
        if any(k in str(exc) for k in ("data-dependent", "GuardOnDataDependent", "Could not guard on")):
            hint = "data-dependent control flow (a branch on a tensor's value): "
        elif any(k in str(exc) for k in ("Constraints violated", "specialized", "batch")):
            hint = "the network fixes the batch dimension: "
        raise ExportError(f"{who}.export(format='onnx'): module {_culprit(module, exc)} cannot be exported to "
                          f"ONNX: {hint}{reason}") from exc
    program.save(str(file))


def _run_torch_artifact(fmt: str, file: Path, inputs: list[np.ndarray]) -> list[np.ndarray]:
    if fmt == "torchscript":
        import torch

        loaded = torch.jit.load(str(file), map_location="cpu")
        with torch.no_grad():
            return _torch_outputs(loaded(*[torch.from_numpy(np.ascontiguousarray(x)) for x in inputs]))
    return run_onnx(file, inputs)


def export_torch(stage: Any, path: str | os.PathLike, format: str = "torchscript", example: Any = None,  # noqa: A002
                 verify: bool = True, opset: int | None = None, rtol: float = 1e-4,
                 atol: float = 1e-5) -> dict[str, Any]:
    """``TorchModel.export`` (see the module docstring); returns the manifest written beside the artifact."""
    import copy

    import torch

    check_format(stage, format, TORCH_FORMATS)
    if stage.getModel() is None:
        raise ExportError(f"{type(stage).__name__}.export: the stage has no model")
    inputs = [np.ascontiguousarray(x) for x in example_inputs(stage, example)]
    module = copy.deepcopy(stage.getModel()).cpu().eval()
    tensors = tuple(torch.from_numpy(x) for x in inputs)
    with torch.no_grad():
        expected = _torch_outputs(module(*tensors))
    input_names = [s["name"] for s in stage._feature_specs()]
    output_names = stage.getOutputCols() if len(stage.getOutputCols()) == len(expected) else \
        [f"output_{i}" for i in range(len(expected))]
    directory, file = target(path, format)
    if format == "torchscript":
        _torchscript(stage, module, tensors).save(str(file))
    else:
        _onnx(stage, module, tensors, input_names, output_names, file, opset)
    manifest = write_manifest(stage, directory, format, "torch", inputs, expected, input_names,
                               {"torch": torch.__version__})
    if verify:
        for batch in verify_inputs(inputs):
            with torch.no_grad():
                want = _torch_outputs(module(*(torch.from_numpy(x) for x in batch)))
            compare(type(stage).__name__ + ".export", format, _run_torch_artifact(format, file, batch), want,
                     rtol, atol)
    return manifest


def _culprit(module: Any, exc: BaseException) -> str:
    """``"'<path>' (<Class>)"`` of the innermost submodule of ``module`` whose ``forward`` is on ``exc``'s
    traceback (the module the export failed in), else the network's own class."""
    names = {id(m): n for n, m in module.named_modules()}
    found = None
    tb = exc.__traceback__
    seen: set[int] = set()
    chain: BaseException | None = exc
    while chain is not None and id(chain) not in seen:  # the error and the errors it was raised from
        seen.add(id(chain))
        tb = chain.__traceback__
        while tb is not None:
            candidate = tb.tb_frame.f_locals.get("self")
            if candidate is not None and id(candidate) in names:
                found = candidate
            tb = tb.tb_next
        chain = chain.__cause__ or chain.__context__
    if found is None:
        return f"{type(module).__name__} (the network)"
    path = names[id(found)] or "<the network>"
    return f"{path!r} ({type(found).__name__})"


def _in_chain(exc: BaseException, kind: type) -> BaseException | None:
    """The first error of type ``kind`` among ``exc`` and the errors it was raised from or during."""
    seen: set[int] = set()
    chain: BaseException | None = exc
    while chain is not None and id(chain) not in seen:
        if isinstance(chain, kind):
            return chain
        seen.add(id(chain))
        chain = chain.__cause__ or chain.__context__
    return None
