"""Reading documents from files for ``edgesync docs add``, as the dicts
``EdgeSync.add_documents`` takes.

* ``FILE.jsonl``: one JSON object per line with ``text`` (or ``context``) and optional
  ``title``, ``source`` (or ``doc_id``/``id``); blank lines ignored; any bad line refuses the
  whole file (:class:`DocumentFileError` naming ``file:line``).
* ``FILE.txt`` / ``FILE.md``: one document titled with the file name.
* ``DIR``: every ``*.txt`` and ``*.md`` under it, sorted; source = the relative path; a file
  not UTF-8 or blank is skipped and reported (:attr:`DocumentFiles.skipped`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

TEXT_SUFFIXES = (".txt", ".md")
"""File name endings read as one document each (case-insensitive)."""
JSONL_SUFFIX = ".jsonl"

__all__ = ["DocumentFileError", "DocumentFiles", "SourceDocument", "read_documents"]


class DocumentFileError(ValueError):
    """A path or a line that cannot be read as documents; the message names it (``path`` or ``path:line``)."""


@dataclass(frozen=True)
class SourceDocument:
    """One document read from a file: ``origin`` (``file.jsonl:3`` or the path, for messages) and
    ``document`` (``{"text", "title", "source"}``, strings)."""

    origin: str
    document: dict


@dataclass
class DocumentFiles:
    """What :func:`read_documents` found: the documents in input order, and the text files of
    directories that were skipped as ``(path, reason)``."""

    documents: list[SourceDocument] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)


def _jsonl_document(obj, where: str) -> dict:
    if not isinstance(obj, dict):
        raise DocumentFileError(f"{where}: expected a JSON object with \"text\" or \"context\", "
                                f"got {type(obj).__name__}")
    text = obj.get("text", obj.get("context"))
    if not isinstance(text, str):
        raise DocumentFileError(f"{where}: the object has no string \"text\" or \"context\"")
    if not text.strip():
        raise DocumentFileError(f"{where}: the text is empty")
    source = obj.get("source") or obj.get("doc_id") or obj.get("id") or ""
    return {"text": text, "title": str(obj.get("title") or ""), "source": str(source)}


def read_jsonl(path: Path) -> list[SourceDocument]:
    """The documents of a JSON Lines file; DocumentFileError if unreadable, malformed or empty."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DocumentFileError(f"{path}: not UTF-8 (byte {exc.start})") from None
    except OSError as exc:
        raise DocumentFileError(f"{path}: cannot read: {exc.strerror or exc}") from None
    out = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DocumentFileError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        out.append(SourceDocument(where, _jsonl_document(obj, where)))
    if not out:
        raise DocumentFileError(f"{path}: no documents (the file is empty)")
    return out


def _text_file(path: Path, source: str) -> tuple[SourceDocument | None, str | None]:
    """``(document, None)``, or ``(None, why it is skipped)``."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"not UTF-8 (byte {exc.start})"
    except OSError as exc:
        return None, f"cannot read: {exc.strerror or exc}"
    if not text.strip():
        return None, "empty"
    return SourceDocument(str(path), {"text": text, "title": path.name, "source": source}), None


def read_directory(root: Path, found: DocumentFiles) -> None:
    """Append the ``*.txt``/``*.md`` files under ``root`` to ``found``; DocumentFileError if none."""
    files = sorted(p for p in root.rglob("*") if p.suffix.lower() in TEXT_SUFFIXES and p.is_file())
    if not files:
        raise DocumentFileError(f"{root}: no {' or '.join('*' + s for s in TEXT_SUFFIXES)} files in the directory")
    for path in files:
        doc, reason = _text_file(path, path.relative_to(root).as_posix())
        if doc is not None:
            found.documents.append(doc)
        else:
            found.skipped.append((str(path), reason or "unreadable"))


def read_documents(paths: Sequence[str | Path]) -> DocumentFiles:
    """Every document of ``paths`` (JSON Lines files, text files, directories), in order. Raises
    DocumentFileError for a missing path, another kind of file, a bad file, or no document at all."""
    found = DocumentFiles()
    for given in paths:
        path = Path(given).expanduser()
        if path.is_dir():
            read_directory(path, found)
        elif not path.exists():
            raise DocumentFileError(f"{path}: no such file or directory")
        elif path.suffix.lower() == JSONL_SUFFIX:
            found.documents.extend(read_jsonl(path))
        elif path.suffix.lower() in TEXT_SUFFIXES:
            doc, reason = _text_file(path, path.name)
            if doc is None:
                raise DocumentFileError(f"{path}: {reason}")
            found.documents.append(doc)
        else:
            raise DocumentFileError(f"{path}: expected a .jsonl file, a .txt or .md file, or a directory")
    if not found.documents:
        raise DocumentFileError("no documents to add: every text file was skipped")
    return found
