"""Position-bias evaluation: does the answer depend on where the gold document sits?

Every evaluation kind runs through one loop (`runs`); a kind is one `Evaluation` subclass with
its own plan, scorer, report, pairing (for `compare`) and command, registered by its `kind`:

    cli.py               report, compare, suite-data, build-qa, the options commands share, and
                         the command of every registered kind
    method_engines.py    a resolved method's model (RoPE-type variants) and engine; seeds shared
                         across processes
    report.py            summaries, tables, plots and `compare` for any run folder
    runs/                the one run loop
        loop.py          Evaluation (a kind's plan and scorer) and run_evaluation: lock, resume, refuse
        manifest.py      what was run, on which model, with which code; sessions
        results.py       results.jsonl: records appended batch by batch, each exactly once
        ray_backend.py   units of work fanned out to Ray workers, one model replica each
        units.py         what turns a unit of work into records (the loop's and the workers' view)
    data/                the examples evaluations run on
        records.py       documents, QA and key-value examples in the lost-in-the-middle formats
        loaders.py       JSON-lines files in and out (gzipped when named .gz)
        synthetic.py     seeded synthetic examples (key-value retrieval, invented QA)
        build_qa.py      multi-document QA built from an oracle file with our retriever
        prompts.py       the lost-in-the-middle prompts, character for character
    scoring/             turning model outputs into scores
        model_scores.py  greedy answers, gold-answer log-likelihood, forced choice
        metrics.py       answer accuracy, per-position summaries, bootstrap and paired tests
        text_metrics.py  LongBench / ZeroSCROLLS metrics (F1, ROUGE, edit similarity, ...)
    sweep/               the gold-position sweep (kind "sweep")
        plan.py          settings, examples and batches
        batch_scorer.py  one batch of (example, position, method) into records
        run.py           run_sweep and the sweep command
    suites/              long-context suites and a knowledge check (kind "suite")
        long_context.py  LongBench / ZeroSCROLLS task formats
        knowledge.py     the MMLU format, scored by log-likelihood
        data.py          seeded local task files in those formats
        run.py           run_suite and the suite command
        report.py        suite tables and the side-effect table beside a sweep
    harness.py           lm-evaluation-harness tasks on a rescaled model (kind "harness")
    perplexity.py        perplexity against context length (kind "perplexity")
    e2e.py               questions through the real RAG pipeline (kind "e2e")
    settings_search/     `rag-mspoe calibrate`: searches a method's settings for one model with
                         sweeps (layer factors, a static Ms-PoE head order, hidden dimensions)
    shipping_rule.py     the rule a config ships by, applied to its committed validation
    demo_command.py      `rag-mspoe demo`: the pipelines' demo answers, then its position curves:
    demo_curve.py        the committed one (the shipped method's validation, no model runs)
    live_curve.py        and a live one (a small sweep on this machine)
"""

# Every evaluation kind registers itself (`runs.loop.Evaluation.registry`) when its module is
# imported: importing them here makes every kind known wherever the evaluation is used (its command,
# report, compare, resume). A new kind is one Evaluation subclass, plus its module's line here.
from rag_mspoe.eval import e2e, harness, perplexity  # noqa: E402, F401
from rag_mspoe.eval.suites import run as suite_run  # noqa: E402, F401
from rag_mspoe.eval.sweep import run as sweep_run  # noqa: E402, F401
