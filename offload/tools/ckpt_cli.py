"""The ``offload-ckpt`` command line: export, import, inspect, verify, list and mirror checkpoints.

Exit codes: 0 success, 1 a corrupt, incomplete or unreadable checkpoint (or an I/O error),
2 a bad argument.

Examples::

    offload-ckpt inspect /ckpt/step-0000001000
    offload-ckpt verify /ckpt/step-0000001000
    offload-ckpt verify --local /ckpt/step-0000001000   # a job's checkpoint: only the shards on this node
    offload-ckpt list /ckpt
    offload-ckpt export /ckpt/step-0000001000 adamw.pt       # torch.optim.AdamW.load_state_dict(torch.load(...))
    offload-ckpt export /ckpt/step-0000001000 --model-out model.pt   # model.load_state_dict(torch.load(...))
    offload-ckpt export /ckpt/step-0000001000 --hf out/ --config base/  # AutoModel...from_pretrained("out/")
    offload-ckpt export /ckpt/step-0000001000 --fp32 fp32/ --config base/  # the fp32 masters by name
    offload-ckpt import adamw.pt /ckpt/imported --like /ckpt/step-0000001000
    offload-ckpt mirror /ckpt/step-0000001000 /mnt/remote/ckpt/step-0000001000
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

from .. import checkpoint
from .._version import __version__
from ..checkpoint.commit import reading
from ..checkpoint.format import JOB_FORMAT
from ..checkpoint.manifest import read as read_either
from ..checkpoint.ownership import is_our_format
from ..export import export_fp32, export_hf

PROG = "offload-ckpt"
EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    """The ``offload-ckpt`` argument parser, with every subcommand."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Inspect, verify, export, import and mirror nvme-offload checkpoints (optimizer state, model "
                    "weights).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s (nvme-offload) {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("export", help="write a checkpoint as a torch optimizer state_dict (torch.save), and "
                                      "its model weights as a model state_dict")
    p.set_defaults(run=_export)
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory")
    p.add_argument("out", metavar="OUT.pt", nargs="?",
                   help="file for the optimizer state_dict (replaced atomically)")
    p.add_argument("--no-master", action="store_true",
                   help="leave out the fp32 master copy of fp16/bf16 parameters (torch's optimizers ignore it)")
    p.add_argument("--model-out", metavar="MODEL.pt",
                   help="file for the model's state_dict (model.load_state_dict accepts it); needs host "
                        "memory for every weight at once")
    p.add_argument("--hf", metavar="DIR",
                   help="write the model's weights as a Hugging Face checkpoint (sharded safetensors), one "
                        "tensor in memory at a time; DIR must be new or empty")
    p.add_argument("--fp32", metavar="DIR",
                   help="write the optimizer's fp32 master weights by parameter name as a Hugging Face checkpoint "
                        "(DeepSpeed's zero_to_fp32); the checkpoint must have been saved with model=")
    p.add_argument("--config", metavar="HF_DIR",
                   help="with --hf or --fp32: a Hugging Face model directory whose config.json (and "
                        "generation_config.json) go with the weights, its dtype set to theirs, so that "
                        "from_pretrained loads DIR as it is")
    p.add_argument("--max-shard-size", default="5GB", help="with --hf or --fp32: bytes per shard at most "
                   "(default 5GB)")
    p.add_argument("--overwrite", action="store_true",
                   help="with --hf or --fp32: replace a Hugging Face checkpoint at DIR (never a directory with other "
                        "files)")

    p = sub.add_parser("import", help="write a torch optimizer state_dict file as a checkpoint")
    p.set_defaults(run=_import)
    p.add_argument("state_dict", metavar="IN.pt", help="a file torch.save wrote (an optimizer state_dict)")
    p.add_argument("checkpoint", metavar="CKPT",
                   help="checkpoint directory to write: a new or empty directory, or a checkpoint (replaced "
                        "atomically); any other directory is refused")
    p.add_argument("--like", metavar="CKPT_OR_CONFIG",
                   help="a checkpoint of the same model (shapes, dtypes and settings are taken from it), or "
                        "a config file (JSON, DeepSpeed ds_config.json works) for the unit size and threshold")

    p = sub.add_parser("inspect", help="print a summary of a checkpoint's manifest")
    p.set_defaults(run=_inspect)
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory")
    p.add_argument("--json", action="store_true", help="print the whole manifest as JSON")

    p = sub.add_parser("verify", help="check every file's size and checksum")
    p.set_defaults(run=_verify)
    p.add_argument("checkpoints", metavar="CKPT", nargs="+", help="checkpoint directories")
    p.add_argument("--local", action="store_true",
                   help="for a job's checkpoint (saved by every rank of a torch.distributed job), check the "
                        "shards that are here and let the others be on other nodes; without it a missing "
                        "shard fails, named")

    p = sub.add_parser("list", help="list the checkpoints in a directory (a Retention root), a job's with its "
                                    "shards here")
    p.set_defaults(run=_list)
    p.add_argument("root", metavar="DIR", help="directory holding checkpoints")

    p = sub.add_parser("mirror", help="copy a checkpoint to a second level (another drive, a network mount), "
                                      "atomically, verified after the copy")
    p.set_defaults(run=_mirror)
    p.add_argument("source", metavar="SRC", help="checkpoint directory to copy")
    p.add_argument("destination", metavar="DST",
                   help="the copy's directory: new or empty, or a checkpoint (its files replaced by the copy's, "
                        "committed by one rename); any other directory is refused")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="show a progress bar (default: when stderr is a terminal)")
    return parser


def _export(args) -> int:
    if args.out is None and args.model_out is None and args.hf is None and args.fp32 is None:
        print(f"{PROG} export: error: give OUT.pt (the optimizer), --model-out MODEL.pt, --hf DIR (the model) or "
              "--fp32 DIR (the fp32 masters)", file=sys.stderr)
        return EXIT_USAGE
    if args.hf is not None and args.fp32 is not None and os.path.abspath(args.hf) == os.path.abspath(args.fp32):
        print(f"{PROG} export: error: --hf and --fp32 name the same directory; give each its own", file=sys.stderr)
        return EXIT_USAGE
    with reading(args.checkpoint):  # no save replaces it while it is read
        if args.out is not None:
            checkpoint.export_checkpoint(args.checkpoint, args.out, include_master=not args.no_master)
            print(f"wrote {args.out}")
        if args.model_out is not None:
            checkpoint.export_model_checkpoint(args.checkpoint, args.model_out)
            print(f"wrote {args.model_out}")
        for out, export in ((args.hf, export_hf), (args.fp32, export_fp32)):
            if out is not None:
                written = export(args.checkpoint, out, config=args.config, max_shard_size=args.max_shard_size,
                                 overwrite=args.overwrite)
                print(f"wrote {written}")
                if args.config is None:
                    print(f"{PROG} export: note: no --config, so {out} has no config.json; from_pretrained needs one",
                          file=sys.stderr)
    return EXIT_OK


def _import(args) -> int:
    like, config = None, None
    if args.like is not None:
        if os.path.isdir(args.like):
            like = args.like
        elif os.path.isfile(args.like):
            config = args.like
        else:
            print(f"{PROG} import: error: --like {args.like} is neither a checkpoint directory nor a "
                  "config file", file=sys.stderr)
            return EXIT_USAGE
    if not os.path.isfile(args.state_dict):
        print(f"{PROG} import: error: {args.state_dict} is not a file", file=sys.stderr)
        return EXIT_USAGE
    path = checkpoint.import_state_dict(args.state_dict, args.checkpoint, like=like, config=config)
    print(f"wrote {path}")
    return EXIT_OK


def _inspect(args) -> int:
    with reading(args.checkpoint):
        if args.json:
            print(json.dumps(checkpoint.read_manifest(args.checkpoint), indent=1, sort_keys=True))
        else:
            print(checkpoint.inspect_checkpoint(args.checkpoint))
    return EXIT_OK


def _mirror(args) -> int:
    if not os.path.isdir(args.source):
        print(f"{PROG} mirror: error: {args.source} is not a directory", file=sys.stderr)
        return EXIT_USAGE
    path = checkpoint.mirror_checkpoint(args.source, args.destination, progress=args.progress)
    print(f"wrote {path} (verified)")
    return EXIT_OK


def _verify(args) -> int:
    failed = 0
    for path in args.checkpoints:
        try:
            manifest = checkpoint.verify_checkpoint(path, local=args.local)
        except (checkpoint.CheckpointError, OSError) as err:
            print(f"{path}: FAILED: {_describe(err)}")
            failed += 1
        else:
            print(f"{path}: OK" + _shards_here(path, manifest, " ({}: verified)"))
    return EXIT_FAILURE if failed else EXIT_OK


def _list(args) -> int:
    if not os.path.isdir(args.root):
        print(f"{PROG} list: error: {args.root} is not a directory", file=sys.stderr)
        return EXIT_USAGE
    for name in sorted(os.listdir(args.root)):
        path = os.path.join(args.root, name)
        if not os.path.isdir(path) or not is_our_format(path):
            continue
        try:
            with reading(path) as path:
                m = read_either(path).to_json()
        except (checkpoint.CheckpointError, OSError) as err:
            print(f"{name}: unreadable: {_describe(err)}")
            continue
        print(f"{name}: step {m.get('step')}, {m.get('created')}" + _shards_here(path, m, ", {}"))
    return EXIT_OK


def _shards_here(path: str, manifest: dict, form: str) -> str:
    """For a job's checkpoint, ``form`` filled with its size and the shards in ``path``; else nothing."""
    if manifest.get("format") != JOB_FORMAT:
        return ""
    here = [s["name"] for s in manifest["shards"] if os.path.isdir(os.path.join(path, s["name"]))]
    missing = [s["name"] for s in manifest["shards"] if s["name"] not in here]
    text = f"job of {manifest['world_size']} ranks, {len(here)} of {manifest['world_size']} shards here"
    return form.format(text + (f"; not here: {', '.join(missing)}" if missing else ""))


def _describe(err: Exception) -> str:
    """The error's message; an OSError whose message already names its file without the
    ``[Errno N] ...: 'path'`` repetition."""
    if isinstance(err, OSError) and err.strerror and err.filename is not None \
            and os.fspath(err.filename) in err.strerror:
        return err.strerror
    return str(err)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``offload-ckpt``; returns the exit code.

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).
    """
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (checkpoint.CheckpointError, OSError) as err:
        print(f"{PROG} {args.command}: error: {_describe(err)}", file=sys.stderr)
        return EXIT_FAILURE
    except ValueError as err:  # e.g. a mirror onto its own source
        print(f"{PROG} {args.command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
