"""Find the files shipped with the package (schemas, configs) from a checkout or an installed wheel."""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def data_dir(kind: str) -> Path:
    """The folder holding `kind` ("schema" or "configs").

    A wheel carries them under dataplane_rl/_data/ (see pyproject's force-include); a checkout or an
    editable install reads the top-level folders of the repository.
    """
    for candidate in (_PACKAGE / "_data" / kind, _PACKAGE.parent / kind):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        f"dataplane-rl data folder '{kind}' not found next to {_PACKAGE}; reinstall the package "
        "(pip install dataplane-rl) or run from a full checkout"
    )


def project_root() -> Path | None:
    """The checkout this package runs from (the folder with pyproject.toml), or None for an installed wheel."""
    root = _PACKAGE.parent
    return root if (root / "pyproject.toml").is_file() and (root / "schema").is_dir() else None


def pip_install_extra(extra: str) -> str:
    """The pip command that adds an extra: editable from the checkout this package runs from, else by name."""
    root = project_root()
    return f"pip install -e '.[{extra}]' in {root}" if root else f"pip install 'dataplane-rl[{extra}]'"
