"""``autopar checkpoint convert``: a sharded DCP checkpoint folder to one ``torch.save`` file,
and back — for small models, to hand a trained model to code that knows no DCP, or to start a
parallel run from a single-process checkpoint.

Checkpoints of a parallel model are torch's own (FSDP2's way, docs/training.md):
``get_state_dict(pmodel, optimizer)`` + ``dcp.save`` on every rank; ``dcp.load`` +
``set_state_dict`` under any plan and world size. The conversion is torch's too
(``torch.distributed.checkpoint.format_utils``), except that a ``torch.save`` file is read with
``weights_only=True`` (no pickled code runs; format_utils would run it). Whichever way, the
result appears whole or not at all (written beside the destination, then renamed), with the
user's normal permissions, and an existing destination is never overwritten.

    $ autopar checkpoint convert ckpt/step-1000 model.pt
    wrote model.pt (a torch.save file) from the DCP checkpoint ckpt/step-1000
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import warnings
import zipfile

from autopar.errors import AutoparError, ErrorKind, first_line
from autopar.files import user_mode

DCP_METADATA = ".metadata"  # every DCP checkpoint folder holds it (FileSystemWriter)


def convert(source: str, destination: str) -> str:
    """Convert ``source`` (a DCP folder, or a ``torch.save`` file) to the other format at
    ``destination``; returns a line saying what was written."""
    if os.path.lexists(destination):
        raise AutoparError(ErrorKind.BAD_INPUT, f"{destination} already exists; give a new path (nothing is "
                           "overwritten)")
    parent = os.path.dirname(os.path.abspath(destination))
    if not os.path.isdir(parent):
        raise AutoparError(ErrorKind.BAD_INPUT, f"cannot write {destination}: folder {parent} does not exist")
    if os.path.isdir(source):
        if not os.path.isfile(os.path.join(source, DCP_METADATA)):
            raise AutoparError(ErrorKind.BAD_INPUT, f"{source} is a folder but not a DCP checkpoint (it has no "
                               f"{DCP_METADATA} file; dcp.save writes one)")
        _dcp_to_file(source, destination, parent)
        return f"wrote {destination} (a torch.save file) from the DCP checkpoint {source}"
    if not os.path.isfile(source):
        raise AutoparError(ErrorKind.BAD_INPUT, f"{source} does not exist")
    _file_to_dcp(source, destination, parent)
    return f"wrote {destination} (a DCP checkpoint folder) from the torch.save file {source}"


def _dcp_to_file(source: str, destination: str, parent: str) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    fd, tmp = tempfile.mkstemp(prefix=".autopar-", suffix=".tmp", dir=parent)
    os.close(fd)
    try:
        try:
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp_to_torch_save(source, tmp)
        except Exception as exc:  # DCP's reader raises many types on a damaged folder
            raise AutoparError(ErrorKind.BAD_INPUT, f"cannot read the DCP checkpoint {source}: "
                               f"{type(exc).__name__}: {first_line(exc)}") from exc
        os.chmod(tmp, user_mode(0o666))
        os.replace(tmp, destination)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _file_to_dcp(source: str, destination: str, parent: str) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    try:
        state = torch.load(source, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, zipfile.BadZipFile, RuntimeError, EOFError, ValueError) as exc:
        raise AutoparError(ErrorKind.BAD_INPUT, f"{source} is not a readable torch.save file of tensors "
                           f"({type(exc).__name__}: {first_line(exc)})") from exc
    if not isinstance(state, dict):
        raise AutoparError(ErrorKind.BAD_INPUT, f"{source} holds a {type(state).__name__}; a checkpoint is a dict "
                           "(a state_dict, or {'model': ..., 'optimizer': ...})")
    tmp = tempfile.mkdtemp(prefix=".autopar-", suffix=".tmp", dir=parent)
    try:
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(state, checkpoint_id=tmp, no_dist=True)
        os.chmod(tmp, user_mode(0o777))  # mkdtemp makes it 0700
        os.replace(tmp, destination)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
