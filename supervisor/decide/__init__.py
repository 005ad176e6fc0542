"""Pure decisions: name what ended an attempt, decide what to do next, pick the rung."""
