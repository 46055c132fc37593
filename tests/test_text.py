"""exporter.text.one_line: the one way an error or a log field is squeezed onto one line."""

from __future__ import annotations

from exporter.text import MESSAGE_LIMIT, one_line


def test_a_composed_message_keeps_every_character_escaped() -> None:
    # a path quoted verbatim may hold a newline: it stays visible, the line stays one
    assert one_line("--kubeconfig /tmp/a\nb: no such file") == "--kubeconfig /tmp/a\\nb: no such file"
    assert one_line("a\x00b\x1b[31mc\u2028d\x85e") == "a\\x00b\\x1b[31mc\\u2028d\\x85e"
    assert one_line("plain text, untouched: é ü 😀") == "plain text, untouched: é ü 😀"


def test_an_exceptions_text_is_laid_out_on_one_line() -> None:
    # amdsmi's style: "Error code:\n\t2 | ..."
    assert one_line(RuntimeError("Error code:\n\t2 | AMDSMI_STATUS_INVAL  ")) == "Error code: 2 | AMDSMI_STATUS_INVAL"
    assert one_line(TimeoutError()) == "TimeoutError"  # no text: its type says what happened
    assert one_line(ValueError("bad \x1b[2J byte")) == "bad \\x1b[2J byte"


def test_long_messages_are_cut_and_say_how_much_is_left_out() -> None:
    long = "x" * (MESSAGE_LIMIT + 123)
    assert one_line(long) == "x" * MESSAGE_LIMIT + "... (123 more characters)"
    assert one_line("x" * MESSAGE_LIMIT) == "x" * MESSAGE_LIMIT
    assert one_line("x" * (MESSAGE_LIMIT + 1)).endswith("x... (1 more characters)")
    assert one_line(OSError("y" * 300), limit=200) == "y" * 200 + "... (100 more characters)"
    # escaping first: what is counted is what would have been shown
    assert one_line("\n" * 300) == "\\n" * 250 + "... (100 more characters)"
