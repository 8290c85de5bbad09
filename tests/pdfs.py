"""Small PDFs made in memory with pypdf, for the file-input tests (ingest.parsers.file_inputs)."""

from __future__ import annotations

import io

from pypdf import PdfWriter
from pypdf.generic import DecodedStreamObject, DictionaryObject, NameObject


def pdf_with_text(*pages: str, password: str | None = None) -> bytes:
    """A PDF with one page per string, each drawing its string in Helvetica (an empty string: a page with
    no text, as a scanned page has none); encrypted (RC4, which pypdf runs without extra packages) when a
    `password` is given."""
    writer = PdfWriter()
    font = writer._add_object(  # pypdf has no public call that adds a font; its writer's object table is the way
        DictionaryObject({NameObject("/Type"): NameObject("/Font"), NameObject("/Subtype"): NameObject("/Type1"), NameObject("/BaseFont"): NameObject("/Helvetica")})
    )
    for text in pages:
        page = writer.add_blank_page(width=612, height=792)
        page[NameObject("/Resources")] = DictionaryObject({NameObject("/Font"): DictionaryObject({NameObject("/F1"): font})})
        stream = DecodedStreamObject()
        escaped = text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")
        stream.set_data(f"BT /F1 12 Tf 72 720 Td ({escaped}) Tj ET".encode("latin-1") if text else b"")
        page[NameObject("/Contents")] = writer._add_object(stream)
    if password is not None:
        writer.encrypt(user_password=password, algorithm="RC4-128")
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()
