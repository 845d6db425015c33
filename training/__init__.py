"""Drafter training: the layer above ``eval`` (whose MBPP loader and prompts it uses).

* ``training.distill``   -- the self-distillation data both loops share: MBPP prompts in the
  evaluation harness's instruction styles, the target's own answers (cached), padded batches, the
  target's features, the learning-rate schedule, loading the target;
* ``training.medusa``    -- the Medusa heads' loop and its held-out acceptance table
  (``specdec train-medusa``);
* ``training.eagle``     -- the EAGLE head's unrolled loop (``specdec train-eagle``);
* ``training.exercises`` -- prompts the target writes itself: programming exercises from MBPP tasks,
  and general prompts in the style of a few seed prompts;
* ``training.sources``   -- where the training prompts come from: MBPP (the default), a user's prompt
  file (``eval.datasets.load_prompt_file``), prompts written from seeds, the general mix (MBPP plus
  prompts written from the built-in seeds in ``training/data/``).

Nothing below this package imports it; the command line (``specdec.cli.train``) parses the
flags into ``MedusaRun`` / ``EagleRun`` and calls ``run_medusa`` / ``run_eagle``.
"""
