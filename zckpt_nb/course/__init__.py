"""The course's own code: only what several notebooks reuse.

What belongs here: how the course prints (`show`: one table renderer, one number format, one visible `check`), the
figures several notebooks draw (`plots`), what starts a lesson's jobs (`runs`: a command line run as a learner types
it, bounded; several small jobs at once) and the notebook runner (`notebooks`, `python -m zckpt_nb.course.notebooks`).

What stays in the notebooks' cells: everything a lesson teaches. How a figure is measured (bytes read from the files,
losses compared, a stall or a memory peak taken), every sentence about a result (markdown, or a short f-string
beside the number it prints), every verdict (a `check` the learner reads). Nothing here writes a sentence about a
run, and the library (everything outside `course/` and `examples/`) never imports this package.
"""
