"""Label new inputs with a trained classifier: BERT sequence or token classification, or a ViT.

  python -m transformer.predict --workdir runs/bert-reviews --input reviews.txt [--output preds.jsonl] \
      [--step 200] [--top_k 3]
  python -m transformer.predict --workdir runs/vit-flowers --input photos/

--input: a sequence classifier's texts, one a line, or a labelled TSV (`label<TAB>text`, as training reads
it); a token classifier's sentences, one a line (words at whitespace), or CoNLL (`token<TAB>tag`, .conll or
.tsv); a ViT's image files: a folder (recursively), one file, or a text file naming one a line.
Writes one JSON line per input to --output (default: stdout):

  {"input": "a gripping film", "label": "pos", "probabilities": {"pos": 0.93, "neg": 0.07}, "target": "pos"}
  {"input": ["x", "=", "1"], "words": [{"word": "x", "label": "NAME", "probabilities": {...}}, ...],
   "words_cut": 0}

`probabilities`: every label's (most likely first; --top_k N: the N most likely), `target` the label a
labelled file gives. Label names are the run's (`transformer.inference.classifier`, the Python API:
`classifier.Classifier(rundir.open(DIR))(["a new sentence"])`). GPT and encoder-decoder runs generate instead
(`transformer.generate`).
"""

import json
import sys

from absl import flags

from transformer import cli, rundir
from transformer.inference import classifier


def main(argv):
    f = flags.FLAGS
    classify = classifier.Classifier(rundir.open(f.workdir), f.step, f.top_k)
    inputs, targets = classifier.read_inputs(classify.task, f.input)
    predictions = classify(inputs)
    out = open(f.output, "w", encoding="utf-8") if f.output else sys.stdout
    try:
        for i, (x, prediction) in enumerate(zip(inputs, predictions)):
            target = {"target": targets[i]} if targets else {}
            out.write(json.dumps({"input": x, **prediction, **target}, ensure_ascii=False) + "\n")
    finally:
        if f.output:
            out.close()
    if f.output:
        print(f"{len(predictions)} predictions of step {classify.step} -> {f.output}", file=sys.stderr)


if __name__ == "__main__":
    flags.DEFINE_string("workdir", None, "Run directory of a classifier (config.json, checkpoints, labels).")
    flags.DEFINE_string("input", None, "Texts, a TSV or CoNLL file, or image files / a folder (see above).")
    flags.DEFINE_string("output", "", "JSON lines file to write (default: stdout).")
    cli.define_step()
    flags.DEFINE_integer("top_k", 0, "Probabilities of the k most likely labels (0: all).")
    flags.mark_flags_as_required(["workdir", "input"])
    cli.run(main)
