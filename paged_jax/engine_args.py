"""Command-line flags generated from EngineConfig's fields (vLLM's EngineArgs.add_cli_args).

Each field declares its help, choices and argument group once (`knob` in engine_config.py);
`add_engine_args` turns every field into a flag named after it (`max_num_seqs` ->
`--max-num-seqs`, dest the field's name), typed by its annotation:
- int / float fields take that type; a field that admits str (warm_up, hash_seed) takes a str;
- a bool that defaults to False is a switch (`--interpret`); one that defaults to True is the
  switch that turns it off, named by the field (`--no-prefix-caching`);
- `off_flag` adds a second switch that sets the field to None (`--no-compile-cache`).
Fields whose flag differs (`via`) are the explicit exceptions, each with its reason beside the
field: `--offload-host-mib` (MiB, converted to offload_host_bytes) and `--kv-calibration`
(kv_scales and kv_key_offsets, arrays read from an .npz). `engine_config_kwargs(args)` maps
the parsed flags back to EngineConfig's keyword arguments. Imports no jax.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from paged_jax.core.kv_quant import load_kv_calibration
from paged_jax.engine_config import CACHE, DEVICES, DISAGG, OFFLOAD, SPEC, EngineConfig

MIB = 1 << 20


def _user_fields() -> list[dataclasses.Field]:
    """EngineConfig's fields a caller sets (not those __post_init__ resolves, init=False)."""
    return [field for field in dataclasses.fields(EngineConfig) if field.init]


def _flag(field: dataclasses.Field) -> str:
    return field.metadata["flag"] or "--" + field.name.replace("_", "-")


def _arg_type(annotation) -> type:
    """int / float / str / bool of a field's annotation (str wins in a union that admits it)."""
    members = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    members = [m for m in members if m is not type(None)]
    for candidate in (str, bool, float, int):
        if candidate in members:
            return candidate
    raise TypeError(f"no command-line type for {annotation}: give the field via=... (engine_config.knob)")


def _default_text(value) -> str:
    return "off" if value is None else str(value)


def add_engine_args(parser: argparse.ArgumentParser, defaults: dict | None = None,
                    default_help: dict | None = None) -> dict[str, argparse._ArgumentGroup]:
    """Adds one flag per EngineConfig field (and the explicit exceptions) to `parser`.

    Args:
      defaults: field name -> this command's default where it differs from the field's
        (serve warms up "full"; generate sizes max_num_seqs by its prompts, None until then).
      default_help: field name -> how to say that default in --help, where the value alone
        would mislead (generate's max_num_seqs: "the number of prompts, at most 64").
    Returns:
      The argument groups by name (the CLI adds its own flags of a group there).
    """
    defaults, default_help = defaults or {}, default_help or {}
    groups = {name: parser.add_argument_group(name) for name in (CACHE, OFFLOAD, DEVICES, SPEC, DISAGG)}
    hints = typing.get_type_hints(EngineConfig)
    for field in _user_fields():
        meta = field.metadata
        group = groups[meta["group"]]
        if meta["via"] is not None:
            continue  # added below, with its conversion
        default = defaults.get(field.name, field.default)
        help_text = meta["help"].replace("%", "%%")
        kind = _arg_type(hints[field.name])
        if kind is bool:
            action = "store_false" if field.default else "store_true"
            group.add_argument(_flag(field), dest=field.name, action=action, default=default, help=help_text)
            continue
        shown = default_help.get(field.name, _default_text(default))
        if "default:" not in help_text or field.name in default_help:
            help_text += f" (default: {shown})".replace("%", "%%")
        group.add_argument(_flag(field), dest=field.name, type=kind, default=default, choices=meta["choices"],
                           help=help_text)
        if meta["off_flag"] is not None:
            off, off_help = meta["off_flag"]
            group.add_argument(off, dest=field.name, action="store_const", const=None, help=off_help)
    # the explicit exceptions (their fields say via=...)
    groups[OFFLOAD].add_argument("--offload-host-mib", type=int, default=0,
                                 help="host tier size in MiB (offload_host_bytes; 0: off)")
    groups[CACHE].add_argument("--kv-calibration", default=None, metavar="FILE.npz",
                               help="a quantized cache's key offsets (and per-tensor scales) from `paged-jax "
                                    "calibrate-kv` (kv_key_offsets, kv_scales; default: none: offsets zero, "
                                    "per-tensor scales 1.0)")
    return groups


def engine_config_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig's keyword arguments from flags parsed by a parser add_engine_args built."""
    kwargs = {field.name: getattr(args, field.name) for field in _user_fields() if field.metadata["via"] is None}
    kwargs["offload_host_bytes"] = args.offload_host_mib * MIB
    if args.kv_calibration:
        kwargs.update(load_kv_calibration(args.kv_calibration, args.kv_cache_dtype, args.kv_cache_scaling))
    return kwargs


__all__ = ["add_engine_args", "engine_config_kwargs"]
