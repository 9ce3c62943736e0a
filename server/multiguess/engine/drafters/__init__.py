"""The drafters, one module each: ``model`` (a draft model), ``eagle3`` (an EAGLE-3 head on the
target's features), ``ngram`` (prompt lookup), ``suffix`` (copy drafts alone), over the base in
``base.py`` (the calls and the abilities) and the tree growing the model drafters share
(``growing.py``). ``multiguess.drafting`` names them and builds one by name."""
