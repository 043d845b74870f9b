"""Tool calls and structured output: grammars that constrain decoding, and the calls read back.

grammar          Grammar: a JSON schema, regex or Lark grammar compiled for the tokenizer
json_output      generate_json: an answer that parses against a schema
tool_format      each model family's tool-call markup and the schema of a call
tool_grammar     the grammar that lets a model answer in text or call one of the tools
tool_parsing     calls read out of a finished answer
tool_stream      calls read out of a stream, piece by piece
tool_calls       the engine-level entry points: generate and stream with tools
text_markers     where streamed text may stop inside a marker not yet whole
"""
