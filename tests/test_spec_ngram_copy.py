"""The n-gram drafter's prompt copies (`runtime/spec/ngram_copy.py`): a value the answer copies
from its own prompt is drafted from that prompt, not as the previous request's value, and the
trie goes on after it as after another value; anchors that name the wrong word stop drafting."""

from __future__ import annotations

from loom.runtime.req import Req
from loom.runtime.sampling_params import make_sampling_params
from loom.runtime.spec.ngram import NgramLookup, NgramState
from loom.runtime.spec.ngram_copy import PromptCopy

# a byte-level BPE vocabulary: "Ġ" marks a leading space
VOCAB = [
    "<s>", "Ġlives", "Ġin", "ĠOslo", "Oslo", "ĠRome", "Rome", "ĠLima", "Lima", ".", 'Ġ"',
    '"}', "city", '":', "Ġis", "Ġ", "3", "1", "4", "8", ",", "age", "Ġand", "Paris", "{",
]  # fmt: skip
T = {s: i for i, s in enumerate(VOCAB)}


class Tokenizer:
    def convert_ids_to_tokens(self, t: int) -> str:
        return VOCAB[t]

    def decode(self, ids: list[int]) -> str:
        return "".join(VOCAB[t] for t in ids).replace("Ġ", " ")

    def get_vocab(self) -> dict[str, int]:
        return dict(T)


def ids(*words: str) -> list[int]:
    return [T[w] for w in words]


def _req(prompt: list[int], output: list[int] = ()) -> Req:
    req = Req("r", prompt, make_sampling_params({}), seed=0)
    req.output_ids = list(output)
    return req


def _drafter(copy: bool = True) -> NgramLookup:
    d = NgramLookup(min_window=1, max_window=4, branch_length=6, capacity=10_000)
    d.copy = PromptCopy(Tokenizer()) if copy else None
    return d


def _finish(d: NgramLookup, prompt: list[int], output: list[int]) -> None:
    """What the speculator does with a finished request: the trie and the anchors learn it."""
    done = _req(prompt, output)
    d.observe(done, NgramState(4))
    if d.copy is not None:
        d.copy.learn(prompt, output)


CITY = ids("{", "city", '":', 'Ġ"')


def _cities(d: NgramLookup, *cities: str) -> None:
    """Finished answers that each copied the city of their prompt."""
    for city in cities:
        _finish(d, ids("Ġlives", "Ġin", "Ġ" + city, "."), CITY + ids(city, '"}'))


def test_a_value_from_the_prompt_is_drafted_and_the_trie_goes_on_after_it():
    for copy in (False, True):
        d = _drafter(copy)
        _cities(d, "Lima", "Oslo")
        req = _req(ids("Ġlives", "Ġin", "ĠRome", "."), CITY)
        # the trie alone drafts the last answer's city; the copy this prompt's, spelt without
        # its space as the answers did, then what followed the other city there
        want = ids("Rome", '"}') if copy else ids("Oslo", '"}')
        assert d.propose(req, NgramState(4), 3) == want
    assert d.copy.anchors[tuple(CITY[-3:])] == [T["Ġin"], 2, True]


def test_an_anchor_drafts_once_a_second_answer_confirmed_it():
    d = _drafter()
    _cities(d, "Oslo")
    req = _req(ids("Ġlives", "Ġin", "ĠRome", "."), CITY)
    assert d.propose(req, NgramState(4), 2) == ids("Oslo", '"}')
    _cities(d, "Lima")
    assert d.propose(_req(req.origin_input_ids, CITY), NgramState(4), 2) == ids("Rome", '"}')


def test_a_word_of_several_pieces_and_the_value_it_replaces_are_skipped_whole():
    d = _drafter()
    age = ids("{", "age", '":', "Ġ")
    _finish(d, ids("Ġis", "Ġ", "8", "1", "Ġand"), age + ids("8", "1", ","))
    _finish(d, ids("Ġis", "Ġ", "4", "1", "Ġand"), age + ids("4", "1", ","))
    # this prompt's 38: both pieces, then the "," that followed 41 (its 4 and 1 skipped)
    req = _req(ids("Ġis", "Ġ", "3", "8", "Ġand"), age)
    assert d.propose(req, NgramState(4), 4) == ids("3", "8", ",")
    # the budget cuts a copied word too
    assert d.propose(_req(req.origin_input_ids, age), NgramState(4), 1) == ids("3")


def test_an_anchor_that_names_the_wrong_word_stops_drafting():
    d = _drafter()
    _cities(d, "Lima", "Oslo")
    # an answer that wrote another city than the one after "in": the anchor scores 2 - 1
    _finish(d, ids("Ġlives", "Ġin", "ĠRome", "."), CITY + ids("Paris", '"}'))
    assert d.copy.anchors[tuple(CITY[-3:])] == [T["Ġin"], 1, True]
    req = _req(ids("Ġlives", "Ġin", "ĠLima", "."), CITY)
    assert d.propose(req, NgramState(4), 2) == ids("Paris", '"}')  # the trie's draft
    # right again: drafts again
    _cities(d, "Rome")
    assert d.propose(_req(req.origin_input_ids, CITY), NgramState(4), 2) == ids("Lima", '"}')
    # refuted twice (score 0), the next answer that copied a word anchors it afresh
    _finish(d, ids("Ġlives", "Ġin", "ĠRome", "."), CITY + ids("Paris", '"}'))
    _finish(d, ids("Ġlives", "Ġin", "ĠRome", "."), CITY + ids("Paris", '"}'))
    assert d.copy.anchors[tuple(CITY[-3:])][1] == 0
    _finish(d, ids("Ġis", "ĠLima", "."), CITY + ids("Lima", '"}'))
    assert d.copy.anchors[tuple(CITY[-3:])] == [T["Ġis"], 1, True]


def test_a_value_the_trie_knows_at_that_context_is_followed_through_the_trie():
    d = _drafter()
    _cities(d, "Oslo")
    _finish(d, ids("Ġlives", "Ġin", "ĠRome", "."), CITY + ids("Rome", '"}', "."))
    # Oslo is newer there, but this prompt names Rome: its own continuation follows
    req = _req(ids("Ġlives", "Ġin", "ĠOslo", "Ġin", "ĠRome", "."), CITY)
    assert d.propose(req, NgramState(4), 3) == ids("Rome", '"}', ".")


def test_a_word_is_copied_as_the_answers_spelt_it():
    d = _drafter()
    said = ids("{", "Ġis")
    for city in ("Lima", "Oslo"):  # answers that kept the space
        _finish(d, ids("Ġlives", "Ġin", "Ġ" + city, "."), said + ids("Ġ" + city, "."))
    req = _req(ids("Ġlives", "Ġin", "ĠRome", "."), said)
    assert d.propose(req, NgramState(4), 2) == ids("ĠRome", ".")


def test_tokens_without_a_spaceless_spelling_or_that_are_no_words_are_not_copied():
    copy = PromptCopy(Tokenizer())
    assert copy.token(T["ĠRome"]) == (T["Rome"], True, True)
    assert copy.token(T["Ġand"]) == (T["Ġand"], True, True)  # no "and" in the vocabulary
    assert copy.token(T["."]) == (T["."], False, False)
    assert copy.is_piece(T["1"]) and not copy.is_piece(T["Ġis"])
    prompt = ids("Ġlives", "Ġin", ".", "Ġis", "Ġand", "Ġis")
    index = copy.index(prompt)
    assert copy.word(prompt, index, T["Ġin"], True) == []  # "." is no word
    assert copy.word(prompt, index, T["Ġis"], True) == []  # "and" has no bare spelling
    assert copy.word(prompt, index, T["Ġis"], False) == ids("Ġand")
    assert copy.word(prompt, index, T["Ġand"], False) == ids("Ġis")
    end = ids("Ġlives", "Ġin")
    assert copy.word(end, copy.index(end), T["Ġin"], False) == []  # nothing after it


class _Refuses:
    """A grammar with no forced text that refuses one token (greedy drafts walk it lazily:
    accept_token and rollback only)."""

    def __init__(self, refused: int):
        self.refused = refused

    def jump_forward(self) -> str:
        return ""

    def accept_token(self, t: int) -> None:
        from loom.grammar.base import GrammarError

        if t == self.refused:
            raise GrammarError(f"refused {t}")

    def rollback(self, n: int) -> None:
        pass


def test_a_skip_gram_the_grammar_refuses_is_drafted_again_from_the_exact_match():
    from loom.runtime.server_args import ServerArgs
    from loom.runtime.spec.speculator import NgramSpeculator

    spec = NgramSpeculator(ServerArgs(speculative_algorithm="NGRAM"), None, 384, [2])
    # "1 2 3" was followed by 50 7 8 (the skip-gram after "1 2 3 60": 7 8), and 60 by 9 9
    spec.ngram.observe(_req([60, 9, 9, 4, 1, 2, 3, 50, 7, 8]), NgramState(7))

    def draft(grammar) -> list[int]:
        req = Req("r", [4, 1, 2, 3, 60], make_sampling_params({"temperature": 0}), seed=0)
        req.grammar = grammar
        return spec.draft(req, 8)

    assert draft(None)[:2] == [7, 8]
    assert draft(_Refuses(7))[:2] == [9, 9]


def test_the_prompt_index_starts_where_asked():
    prompt = ids("Ġin", "ĠRome", "Ġin", "ĠOslo", ".")
    assert PromptCopy.index(prompt) == {T["Ġin"]: 2, T["ĠRome"]: 1, T["ĠOslo"]: 3}
    assert PromptCopy.index(prompt, 3) == {T["ĠOslo"]: 3}


def test_sequential_extractions_with_prompt_copies_equal_plain_decoding(monkeypatch):
    """End to end on the bundled model: JSON extractions one after another (so finished
    answers confirm anchors and later requests draft their values from their own prompts),
    radix cache on and off: every output is plain decoding's, validates, and copies were
    drafted and accepted (the path is exercised, not bypassed)."""
    import json

    import jsonschema

    from loom.runtime.server_args import BUNDLED_MODEL_PATH
    from tests.runtime_helpers import make_scheduler, run_all, submit

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
        "required": ["name", "city"],
        "additionalProperties": False,
    }
    people = [("Alice", "Paris"), ("Bob", "Berlin"), ("Carla", "Madrid"), ("Daniel", "Rome"),
              ("Emma", "Vienna"), ("Farid", "Cairo"), ("Grace", "Tokyo"), ("Hugo", "Lisbon")]  # fmt: skip
    drafted: list[list[int]] = []
    real = PromptCopy.draft

    def counting(self, prompt, index, context):
        word = real(self, prompt, index, context)
        if word:
            drafted.append(word)
        return word

    monkeypatch.setattr(PromptCopy, "draft", counting)
    for radix_off in (False, True):
        outs = {}
        for spec in (False, True):
            extra = {"speculative_algorithm": "NGRAM"} if spec else {}
            sched = make_scheduler(BUNDLED_MODEL_PATH, disable_radix_cache=radix_off, **extra)
            tok = sched.tokenizer
            got = []
            for i, (name, city) in enumerate(people):  # one request at a time
                text = tok.apply_chat_template(
                    [{"role": "user", "content": f"Extract name and city as JSON: {name} lives in {city}."}],
                    tokenize=False,
                    add_generation_prompt=True,
                )  # fmt: skip
                params = {"max_new_tokens": 48, "temperature": 0, "json_schema": json.dumps(schema)}
                submit(sched, f"r{i}", tok.encode(text), params)
                got.append(run_all(sched)[f"r{i}"])
            outs[spec] = got
            if spec:
                assert sched.get_state()["spec_verify_ct"] > 0
        for plain, spec in zip(outs[False], outs[True]):
            assert spec.ids == plain.ids
            if spec.finish_reason["type"] == "stop":
                jsonschema.validate(json.loads(spec.text), schema)
    assert drafted, "no request drafted a value copied from its prompt"
