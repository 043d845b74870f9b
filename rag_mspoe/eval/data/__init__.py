"""The examples evaluations run on: record formats, files, synthetic examples, built QA, prompts."""
