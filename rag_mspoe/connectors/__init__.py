"""Adapters to LangChain, LlamaIndex and an OpenAI-style HTTP server (each module imports its
framework; install the matching extra), and `format_documents`, the prompt layout that tells
methods reading documents where each one is."""

from rag_mspoe.connectors.documents import format_documents

__all__ = ["format_documents"]
