"""Export a snapshot for other tools.

The arguments `SRC DST [--format FORMAT]` are short for `src=SRC dst=DST format=FORMAT`.
safetensors: DST a directory of model.safetensors (the float32 weights under the model's own names),
config.json (the GPTConfig) and vocab.json (each character's token id); hf: a directory that
transformers' GPT2LMHeadModel.from_pretrained(DST) loads; snapshot: one snapshot file (local path or
fsspec URL) of the weights and the run's record (its configs, vocabulary and step) without optimizer
state, which init_from, generate and score read. DST only ever holds a complete export."""

import dataclasses
import glob
import json
import logging
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass

import torch
from safetensors.torch import save as safetensors_bytes

from mingpt.command import command, find_snapshot, parse_args, write
from mingpt.config import ConfigError, check, check_fields, key
from mingpt.model import GPT
from mingpt.snapshot import reader, single_file
from mingpt.storage import fsync_dir

log = logging.getLogger(__name__)

FORMATS = ("safetensors", "hf", "snapshot")
WEIGHTS = reader.EXPORT_WEIGHTS
CONFIG = "config.json"
VOCAB = "vocab.json"
# a directory export's files, and nothing else
EXPORT_FILES = {WEIGHTS, CONFIG, VOCAB}
# GPT-2 keeps their weights as (in, out)
CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


class ExportError(ValueError):
    """The export cannot be written where it was asked to go."""


@dataclass
class ExportConfig:
    src: str = key("", f"the snapshot: {reader.HELP}")
    dst: str = key(
        "",
        "where the export goes: absent, or an earlier export of the same kind (a directory, or a "
        "snapshot file); never another file or a device",
    )
    format: str = key("safetensors", f"{', '.join(FORMATS)}: see below", valid=FORMATS)

    def __post_init__(self) -> None:
        check(bool(self.src), "src", "must be given")
        check(bool(self.dst), "dst", "must be given")
        check_fields(self)


def hf_config(model: GPT) -> dict:
    """GPT2Config's fields for this model: the same arithmetic (pre-LayerNorm blocks with biases,
    attention scaled by 1/sqrt(head size), a 4x MLP), its activation and LayerNorm epsilon, and an
    untied head."""
    c = model.config
    mlp = model.h[0].mlp
    return dict(
        architectures=["GPT2LMHeadModel"],
        model_type="gpt2",
        vocab_size=c.vocab_size,
        n_positions=c.block_size,
        n_embd=c.n_embd,
        n_layer=c.n_layer,
        n_head=c.n_head,
        n_inner=mlp.c_fc.out_features,
        activation_function={"none": "gelu", "tanh": "gelu_pytorch_tanh"}[mlp.gelu.approximate],
        layer_norm_epsilon=model.ln_f.eps,
        resid_pdrop=c.dropout,
        embd_pdrop=c.dropout,
        attn_pdrop=c.dropout,
        scale_attn_weights=True,
        scale_attn_by_inverse_layer_idx=False,
        reorder_and_upcast_attn=False,
        # a character model has no special tokens
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        torch_dtype="float32",
        use_cache=True,
    )


def export_files(model: GPT, meta: dict, hf: bool) -> dict[str, bytes]:
    """The files, from a model (float32 on the CPU, as reader.load_model builds it) and its
    snapshot's record, of a safetensors export (`GPT(GPTConfig(**config.json))` loads its weights
    as they are), or of an hf one: the weights under GPT2LMHeadModel's names, the body under
    `transformer.`, Conv1D's transposed."""
    weights = {}
    for name, tensor in model.state_dict().items():
        if hf and name != "lm_head.weight":
            # h.<i>.attn.c_attn(.weight)
            if name.removesuffix(".weight").split(".", 2)[-1] in CONV1D:
                tensor = tensor.t()
            name = f"transformer.{name}"
        weights[name] = tensor.contiguous()
    config = hf_config(model) if hf else dataclasses.asdict(model.config)
    return {
        WEIGHTS: safetensors_bytes(
            weights, metadata={"format": "pt", "mingpt_step": str(meta["step"])}
        ),
        CONFIG: json.dumps(config, indent=1).encode(),
        VOCAB: json.dumps(
            {c: i for i, c in enumerate(meta["vocab"])}, ensure_ascii=False, indent=1
        ).encode(),
    }


def check_destination(dst: str, directory: bool) -> str | None:
    """DST's local path (symbolic links followed; None for a URL of another file system), once it is
    known to be absent or of the kind the export replaces: a snapshot file (snapshot format), or a
    directory of nothing but an earlier export's files. Another file, a device, pipe or socket is
    never replaced.
    """
    if "://" in dst and not dst.startswith("file://"):
        # Refused here, before the snapshot is read, not once the files are made.
        if directory:
            raise ExportError(
                f"cannot write {dst}: this format writes a local directory, not a URL"
            )
        return None
    path = os.path.realpath(dst.removeprefix("file://"))
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return path
    except OSError as e:  # e.g. a parent that is a file
        raise ExportError(f"cannot write {dst}: {e.strerror or e}") from None
    if stat.S_ISDIR(info.st_mode):
        if not directory:
            raise ExportError(f"{dst} is a directory: the snapshot format writes one file")
        _check_export_directory(dst, path)
    elif not stat.S_ISREG(info.st_mode):
        raise ExportError(
            f"{dst} is not a regular file or directory (a device, pipe or socket): refusing to "
            "replace it"
        )
    elif directory:
        raise ExportError(f"{dst} is a file: this format writes a directory")
    elif not single_file.is_snapshot_file(path):
        raise ExportError(
            f"{dst} is a file that is not a snapshot: refusing to replace it (give a new path, or "
            "an earlier export's file)"
        )
    return path


def _check_export_directory(dst: str, path: str) -> None:
    """ExportError unless the directory at `path` is empty or an earlier export's."""
    try:
        names = set(os.listdir(path))
    # A directory this user may not list: whether it holds other files cannot be known.
    except OSError as e:
        raise ExportError(f"cannot write {dst}: {e.strerror or e}") from None
    others = sorted(names - EXPORT_FILES)
    if others:
        raise ExportError(
            f"{dst} is a directory with other files ({', '.join(others[:3])}): give a new or an "
            "earlier export's directory"
        )
    # An export's files are renamed into place together: some of them alone are another program's.
    missing = sorted(EXPORT_FILES - names)
    if names and missing:
        raise ExportError(
            f"{dst} is not an earlier export (no {', '.join(missing)}): give a new or an earlier "
            "export's directory"
        )


def write_directory(dst: str, files: dict[str, bytes]) -> None:
    """Write `files` into a temporary directory beside DST, then rename it to DST (an earlier export
    there is moved aside first, then removed)."""
    path = check_destination(dst, directory=True)  # a local path: a URL is refused there
    parent, base = os.path.split(path)
    prefix = f".{base}.tmp-"
    tmp = None
    old = None
    try:
        os.makedirs(parent, exist_ok=True)
        for stale in glob.glob(glob.escape(os.path.join(parent, prefix)) + "*"):
            shutil.rmtree(stale, ignore_errors=True)  # left by an export that was killed
        tmp = tempfile.mkdtemp(prefix=prefix, dir=parent)
        for name, data in files.items():
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, 0o755)  # mkdtemp's 0o700 would hide the export from other users
        fsync_dir(tmp)
        if os.path.isdir(path):
            old = f"{tmp}-old"  # beside the new one, whose name mkdtemp made unique
            os.rename(path, old)
        os.rename(tmp, path)
        fsync_dir(parent)
    except OSError as e:
        problem = f"cannot write {dst}: {e.strerror or e}"
        if old and not os.path.exists(path):  # put the earlier export back
            try:
                os.rename(old, path)
            except OSError:
                problem += (
                    f"; the earlier export is left in {old}: rename it back to {dst} before the "
                    "next export, which removes it"
                )
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        raise ExportError(problem) from None
    if old:
        shutil.rmtree(old, ignore_errors=True)


def export(config: ExportConfig) -> dict:
    """Write the export; return the snapshot's record."""
    # Before any work; again when writing.
    check_destination(config.dst, directory=config.format != "snapshot")
    # Which snapshot of a run directory is read is said once the export is written: a refusal is
    # the only line.
    src, note = find_snapshot(config.src, "src")
    if config.format == "snapshot":
        weights, meta = reader.read(src)
        # Where a local DST is a symbolic link, the file it points to is the one checked, and the
        # one replaced: the link stays.
        path = check_destination(config.dst, directory=False) or config.dst
        # Streamed to a temporary file, then renamed.
        single_file.save({"model_state": weights, **meta}, path)
    else:
        model, _, meta = reader.load_model(src, torch.device("cpu"))
        files = export_files(model, meta, config.format == "hf")
        write_directory(config.dst, files)
    if note:
        log.info("%s", note)
    return meta


def overrides(argv: list[str]) -> list[str]:
    """The short forms as key=value: `SRC DST` for src= and dst= (either may be given as a
    key=value instead), `--format F` for format=F."""
    out = []
    paths = []
    args = iter(argv)
    for arg in args:
        if arg == "--format":
            value = next(args, None)
            if value is None:
                raise ConfigError(f"--format: expects one of {', '.join(FORMATS)}")
            arg = f"format={value}"
        elif arg.startswith("--format="):
            arg = arg[2:]
        # A path may hold '=' too: a key=value starts with a name.
        if "=" in arg and arg.partition("=")[0].isidentifier():
            out.append(arg)
        else:
            paths.append(arg)
    # A path fills the first of SRC and DST not given as a key=value (`src=A B`: B is DST); were
    # it to replace one given, that one would be dropped unsaid.
    free = [name for name in ("src", "dst") if not any(a.startswith(f"{name}=") for a in out)]
    if len(paths) > len(free):
        extra = " ".join(paths[len(free) :])
        raise ConfigError(f"{extra}: expected key=value (SRC and DST are given)")
    return [f"{name}={path}" for name, path in zip(free, paths, strict=False)] + out


def run(argv: list[str]) -> None:
    config = parse_args(overrides(argv), ExportConfig, ("src", "dst"))
    # fsspec's memory:// ends with the process (in-process library use keeps it): the command would
    # say it exported to a file already gone. A directory format refuses any URL.
    check(
        config.format != "snapshot" or not config.dst.startswith("memory://"),
        "dst",
        "memory:// ends with the command, and the export with it: give a path or a URL that "
        "outlives it",
    )
    state = export(config)
    write(f"exported {config.src} (step {state['step']}) as {config.format} to {config.dst}\n")


def main(argv: list[str] | None = None) -> None:
    command(
        "export",
        "src=SRC dst=DST [format=safetensors|hf|snapshot]",
        ExportConfig,
        __doc__,
        run,
        (ExportError,),
        argv,
    )


if __name__ == "__main__":
    main()
