"""Where a row's media file is read from: the one rule for image (and, later, video) paths.

The rule separates what a *row* asks for from what the *user* built:

- A relative path is joined to `dataset_dir` and normalised *lexically* (`os.path.normpath`:
  `.` and `..` components are folded without looking at the disk). If the result leaves
  `dataset_dir` (`../x.png`, `images/../../x.png`, enough `..` to reach `/`), the row is bad
  (`image_outside_dataset_dir`) and nothing is opened — unless
  `basic_parameters.allow_paths_outside_dataset_dir: true`.
- Symlinks are the user's: `dataset_dir/images -> /mnt/shared/coco` is followed wherever it
  points, because a row cannot create one. The file read is the normalised path, so the
  checked path and the opened path are the same string (`images/../x.png` is read as
  `dataset_dir/x.png`, never as the parent of the symlink's target).
- An absolute path (also `~/...`) is used as given; the dataset counts the rows that use one.

`dataset_dir` itself is resolved (symlinks included) once, by the caller.
"""

from __future__ import annotations

import os
from pathlib import Path

from mmfsdp.data.errors import BadSample

__all__ = ["media_path"]


def media_path(path: str, dataset_dir: Path, *, allow_outside: bool, reason: str = "image_outside_dataset_dir") -> str:
    """The file to read for a row's media `path`; raises `BadSample(reason)` if a relative path escapes `dataset_dir`.

    Pure string work: nothing on disk is read, so a refused file is never opened. `reason` lets
    other media kinds (videos) report under their own bad-row reason.
    """
    expanded = Path(path).expanduser()
    if expanded.is_absolute():
        return str(expanded)
    normalised = os.path.normpath(dataset_dir / expanded)
    if not allow_outside and not Path(normalised).is_relative_to(dataset_dir):
        raise BadSample(
            reason,
            f"{path} resolves to {normalised}, outside dataset_dir {dataset_dir} (its `..` components leave it; "
            "symlinks inside dataset_dir are followed); set basic_parameters.allow_paths_outside_dataset_dir: true "
            "to accept it",
        )
    return normalised
