"""Turning messages and documents into the tokens a model reads.

chat_template      Prompt, render: the model's chat template over messages or plain text
template_encoding  encoding untrusted text so that it cannot forge special tokens
document_prompts   prompts carrying documents, with each document's token span
qa_prompt          the lost-in-the-middle QA prompt over documents, one a line
document_order     LongContextReorder: the best documents at both ends
"""
