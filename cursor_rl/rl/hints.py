"""The hint library of textual feedback (``cursor_rl.rl.feedback``): edit freely.

One hint per detector, a ``str.format`` template filled with the episode's facts:

* ``{tools}``: the tool names offered, comma-separated;
* ``{tool}``: the tool the turn called (or tried to);
* ``{path}``: the file the turn edited.

A hint is inserted as a user message just before the assistant turn where the
episode went wrong; the policy conditioned on it is the teacher of the tokens after.
Keep hints short: they must fit in the context with the segment they are inserted in.
"""

HINTS = {
    "malformed_tool_call": (
        "Your tool call was malformed or named an unknown tool. These are the tools you "
        "can use: {tools}. Call exactly one of them, with JSON arguments."
    ),
    "repeated_edit": (
        "You already made this same edit to {path} and it did not work. Read the file "
        "again and try a different change."
    ),
    "submitted_without_tests": (
        "Before you submit, run the tests with run_terminal and check that they pass."
    ),
    "edited_tests": (
        "Do not edit the tests ({path}): they are how your work is graded. Change the code "
        "under test instead."
    ),
    "gave_up_early": (
        "You still have turns left. Keep working on the task: read the code, make the "
        "change, run the tests, then call submit."
    ),
}
