"""ddplab's vocabularies: each word once, with one sentence, and the README printing exactly that."""
from __future__ import annotations

import json
import re

import pytest

from ddplab.glossary import NotebookStatus, ReductionLabel, RunStatus, VerdictKind, markdown_table
from ddplab.verdict import Verdict

from readme import readme_section

VOCABULARIES = {VerdictKind: "kind", ReductionLabel: "label", NotebookStatus: "status", RunStatus: "run status"}


@pytest.mark.parametrize("vocabulary", list(VOCABULARIES), ids=lambda v: v.__name__)
def test_the_readme_prints_each_vocabulary_as_the_glossary_defines_it(vocabulary):
    table = markdown_table(vocabulary, VOCABULARIES[vocabulary])
    assert table in readme_section("Verdict vocabulary"), (
        f"README's {vocabulary.__name__} table differs from ddplab.glossary; paste the output of "
        f"python -c 'from ddplab.glossary import *; print(markdown_table({vocabulary.__name__}, "
        f"\"{VOCABULARIES[vocabulary]}\"))'")


@pytest.mark.parametrize("vocabulary", list(VOCABULARIES), ids=lambda v: v.__name__)
def test_each_word_has_one_sentence_of_meaning(vocabulary):
    for term in vocabulary:
        sentences = re.split(r"(?<=[.!?])\s+(?=[A-Z])", term.meaning)
        assert len(sentences) == 1 and term.meaning.endswith("."), (term, term.meaning)


def test_a_word_is_a_string_in_records_json_and_print():
    assert VerdictKind.BY_DESIGN == "by design" and VerdictKind("by design") is VerdictKind.BY_DESIGN
    assert json.dumps({"kind": VerdictKind.NOT_RUN}) == '{"kind": "not run"}'
    assert repr((ReductionLabel.NOT_ROUNDING,)) == "('not rounding',)" and f"{NotebookStatus.TIMED_OUT}" == "timed out"
    assert {"rounding": 1}[ReductionLabel.ROUNDING] == 1


def test_a_verdict_of_a_kind_outside_the_glossary_is_refused_where_it_is_made():
    with pytest.raises(ValueError, match="'fine' is not a VerdictKind: one of 'exact', 'rounding'"):
        Verdict("c", "fine", "s", [])
    assert Verdict.from_dict(Verdict("c", "by design", "s", []).to_dict()).kind is VerdictKind.BY_DESIGN


def test_the_words_other_modules_use_are_the_glossarys():
    from ddplab import numerics
    from ddplab.compare import verdicts

    assert set(numerics.LABELS) == set(ReductionLabel)
    assert set(verdicts.FAILED_STATUSES) <= set(RunStatus) and set(verdicts.FAILED_STATUSES) <= set(VerdictKind)
    # A configuration that did not finish is judged by its run status: every such status is a kind.
    assert {s.value for s in RunStatus} - {"completed"} <= {k.value for k in VerdictKind}
