"""Read documents from files: plain text, Markdown, HTML, PDF and JSONL.

A file that cannot be read (bad encoding, broken PDF, empty, unknown format, a parser that
fails in any way, a broken or looping link) is skipped with a warning and recorded in the
result, so the caller can report every file that did not make it into the index; nothing is
dropped silently, and one bad file never stops the others.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from rag_mspoe.progress import tqdm_disable

logger = logging.getLogger(__name__)

TEXT_SUFFIXES = {".txt", ".text"}
MARKDOWN_SUFFIXES = {".md", ".markdown"}
HTML_SUFFIXES = {".html", ".htm"}
PDF_SUFFIXES = {".pdf"}
JSONL_SUFFIXES = {".jsonl"}
SUPPORTED_SUFFIXES = TEXT_SUFFIXES | MARKDOWN_SUFFIXES | HTML_SUFFIXES | PDF_SUFFIXES | JSONL_SUFFIXES


@dataclass(frozen=True)
class Document:
    """One document's text and where it came from.

    `location` narrows the source down when one file holds many documents (a JSONL line).
    """

    source: str
    title: str
    text: str
    location: str | None = None

    @property
    def key(self) -> str:
        return document_key(self.source, self.location)


def document_key(source: str, location: str | None) -> str:
    """A name unique within an index: the source file, plus the location inside it if any."""
    return f"{source}#{location}" if location else source


@dataclass(frozen=True)
class Skipped:
    source: str
    reason: str


@dataclass
class IngestResult:
    documents: list[Document] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    files_read: int = 0

    def summary(self) -> str:
        text = f"{len(self.documents)} documents from {self.files_read} files"
        if self.skipped:
            text += f", {len(self.skipped)} skipped"
        return text


class UnreadableFile(ValueError):
    """A file (or one record of it) could not be turned into text; the message says why."""


def load_documents(
    paths: str | Path | Sequence[str | Path],
    *,
    text_field: str = "text",
    title_field: str = "title",
    progress: bool | None = None,
    exclude: Sequence[str | Path] = (),
    follow_outside_links: bool = False,
) -> IngestResult:
    """Read every supported file under `paths` (files or folders, searched recursively).

    Hidden files and folders (names starting with '.') are not visited, nor links to folders.
    A link inside a folder to a file outside it is skipped and listed, unless
    `follow_outside_links` (the folder names what gets indexed; a link must not widen it).
    Files inside the `exclude` folders (an index's own folder) are skipped. Raises
    FileNotFoundError for a path that does not exist and ValueError when the paths hold no
    file at all; unreadable files are skipped and listed in `IngestResult.skipped`.
    """
    result = IngestResult()
    listed = [paths] if isinstance(paths, str | Path) else paths
    files = list(_collect_files(listed, result, follow_outside_links))
    if not files and not result.skipped:
        raise ValueError(f"No files found in {_describe(paths)}; point to a folder or files with documents.")
    excluded = [Path(folder).expanduser().resolve() for folder in exclude]
    for path in tqdm(files, desc="Reading", unit="file", disable=tqdm_disable(progress)):
        suffix = path.suffix.lower()
        if any(path.is_relative_to(folder) for folder in excluded):
            _skip(result, path, "a file of the index itself; an index never reads its own files")
            continue
        if suffix not in SUPPORTED_SUFFIXES:
            _skip(result, path, f"unsupported format '{suffix or path.name}'")
            continue
        try:
            documents = _read_file(path, suffix, text_field, title_field, result)
        except (UnreadableFile, OSError) as exc:
            _skip(result, path, str(exc))
            continue
        except Exception as exc:  # a parser's own bug or limit (pypdf raises NotImplementedError, ...)
            _skip(result, path, f"the {suffix[1:].upper()} reader failed ({type(exc).__name__}: {exc})")
            continue
        result.files_read += 1
        result.documents.extend(documents)
    return result


def _collect_files(
    paths: Iterable[str | Path], result: IngestResult, follow_outside_links: bool
) -> Iterable[Path]:
    for raw in paths:
        path = Path(raw).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist; check the path to your documents.")
        if path.is_file():
            yield path.resolve()
            continue
        root = path.resolve()
        for child in sorted(path.rglob("*")):
            if any(part.startswith(".") for part in child.relative_to(path).parts):
                continue
            if child.is_file():
                target = child.resolve()
                if follow_outside_links or target.is_relative_to(root):
                    yield target
                else:
                    _skip(result, child, _outside_link(target))
            elif child.is_symlink():
                _skip(result, child, _link_problem(child))


def _outside_link(target: Path) -> str:
    return (
        f"a link to {target}, outside the documents folder; not followed (index that file by its own "
        "path, or pass --follow-links)"
    )


def _link_problem(link: Path) -> str:
    try:
        link.resolve(strict=True)
    except FileNotFoundError:
        return "a broken link (its target does not exist)"
    except (OSError, RuntimeError):  # RuntimeError: Python 3.11's "Symlink loop"
        return "a link that loops back on itself"
    return "a link to a folder; not followed (index the folder by its own path)"


def _read_file(
    path: Path, suffix: str, text_field: str, title_field: str, result: IngestResult
) -> list[Document]:
    if suffix in JSONL_SUFFIXES:
        return _read_jsonl(path, text_field, title_field, result)
    if suffix in PDF_SUFFIXES:
        title, text = _read_pdf(path)
    elif suffix in HTML_SUFFIXES:
        title, text = _read_html(_decode(path))
    elif suffix in MARKDOWN_SUFFIXES:
        text = _decode(path)
        title = _markdown_title(text)
    else:
        text = _decode(path)
        title = ""
    if not _has_text(text):
        raise UnreadableFile("no text in the file")
    return [Document(source=str(path), title=title or _title_from_name(path), text=text)]


def _has_text(text: str) -> bool:
    """Whether `text` has a visible character: whitespace, NUL bytes and other controls are not text."""
    return any(char.isprintable() and not char.isspace() for char in text)


def _decode(path: Path) -> str:
    try:
        # utf-8-sig drops a byte-order mark; no newline translation, so offsets match the file.
        return path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UnreadableFile(f"not valid UTF-8 (byte {exc.start}); convert the file to UTF-8") from exc


def _markdown_title(text: str) -> str:
    match = re.search(r"^#\s+(.+?)\s*#*\s*$", text, flags=re.MULTILINE)
    return match.group(1) if match else ""


def _read_html(markup: str) -> tuple[str, str]:
    from bs4 import BeautifulSoup

    soup = BeautifulSoup(markup, "html.parser")
    for tag in soup(["script", "style", "noscript", "template"]):
        tag.decompose()
    title = soup.title.get_text(" ", strip=True) if soup.title else ""
    if not title and (heading := soup.find("h1")):
        title = heading.get_text(" ", strip=True)
    if soup.title:
        soup.title.decompose()  # the title is kept as the title, not repeated in the body
    body = soup.get_text("\n")
    # Markup leaves runs of blank lines and indentation; keep paragraphs, drop the rest.
    lines = [re.sub(r"[ \t\r\f\v]+", " ", line).strip() for line in body.splitlines()]
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()
    return title, text


def _read_pdf(path: Path) -> tuple[str, str]:
    from pypdf import PdfReader
    from pypdf.errors import PyPdfError

    try:
        reader = PdfReader(path)
        pages = [page.extract_text() or "" for page in reader.pages]
        title = (reader.metadata.title if reader.metadata else None) or ""
    except (PyPdfError, ValueError, KeyError) as exc:
        raise UnreadableFile(f"not a readable PDF ({exc})") from exc
    return str(title).strip(), "\n\n".join(page.strip() for page in pages).strip()


def _read_jsonl(path: Path, text_field: str, title_field: str, result: IngestResult) -> list[Document]:
    documents = []
    for number, line in enumerate(_decode(path).splitlines(), start=1):
        if not line.strip():
            continue
        location = f"line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            _skip(result, path, f"{location}: invalid JSON ({exc.msg})")
            continue
        text = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(text, str) or not _has_text(text):
            _skip(result, path, f"{location}: no text in field '{text_field}'")
            continue
        title = record.get(title_field)
        documents.append(
            Document(
                source=str(path),
                title=title if isinstance(title, str) and title else f"{_title_from_name(path)} {number}",
                text=text,
                location=location,
            )
        )
    if not documents:
        raise UnreadableFile(f"no record with text in field '{text_field}'")
    return documents


def _title_from_name(path: Path) -> str:
    return re.sub(r"[_-]+", " ", path.stem).strip()


def _skip(result: IngestResult, path: Path, reason: str) -> None:
    logger.warning("Skipping %s: %s", path, reason)
    result.skipped.append(Skipped(source=str(path), reason=reason))


def _describe(paths: str | Path | Sequence[str | Path]) -> str:
    if isinstance(paths, str | Path):
        return str(paths)
    return ", ".join(str(p) for p in paths) or "an empty list of paths"
