"""Rows, from any source to fixed-length token arrays: readers, fields, ingest, chat formatting, tokenization, answers."""
