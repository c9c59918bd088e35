"""`andrea loss --plot` keeps the divergence guard's marks legible (issue 41): a fork and the two
rollbacks right after it (steps 120, 124, 129 of a 240-step branch: today labels printed over one
another) are drawn as one label where they are closer than 2% of the plot's width (about 18 pixels,
rotated 7-point text being about 12 wide); marks further apart keep their own."""

from __future__ import annotations

from andrea_core.ops.loss_view import LossView, Mark, label_groups, plot_view


def test_close_marks_share_one_label():
    marks = [
        Mark(129, "rollback", "rollback to step 120 (loss-spike)"),
        Mark(120, "forked-from", "forked from base at step 120"),
        Mark(124, "rollback", "rollback to step 120 (loss-spike)"),
        Mark(230, "guard-stop", "guard stop (loss-spike)"),
    ]
    groups = label_groups(marks, span=240)
    expected = [(120, [120, 124]), (129, [129]), (230, [230])]  # 4.8 steps: 2% of 240
    assert [(step, [m.step for m in group]) for step, group in groups] == expected
    # At 1%, 2.4 steps, none is close: each its own label.
    assert len(label_groups(marks[:3], span=240, gap=0.01)) == 3


def test_a_plot_with_many_guard_marks_draws():
    marks = [Mark(100 + 3 * i, "rollback", f"rollback to step 100 ({i})") for i in range(40)]
    view = LossView("run", [], [], marks=marks)
    png = plot_view(view, "branch")
    assert png.startswith(b"\x89PNG")
