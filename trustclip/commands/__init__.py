"""The `trustclip` subcommands (see trustclip.cli); helpers shared by several of them."""

from __future__ import annotations

from pathlib import Path


def check_figure_path(path: str | Path, flag: str = "--plot") -> None:
    """A figure file matplotlib can write (its format from the suffix), in a folder that is not a file."""
    from matplotlib.backend_bases import FigureCanvasBase

    path = Path(path)
    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = path.suffix.lower().lstrip(".")
    if suffix not in formats:
        raise ValueError(f"{flag} {str(path)!r}: matplotlib writes {', '.join(sorted(formats))}; give a file name "
                         "ending in one of them (e.g. .png)")
    if path.is_dir():
        raise ValueError(f"{flag} {str(path)!r} is a folder; give a file name")
    existing = next(p for p in path.absolute().parents if p.exists())
    if not existing.is_dir():
        raise ValueError(f"{flag} {str(path)!r}: {existing} is a file, so the folder cannot be made")
