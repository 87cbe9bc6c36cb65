# The commands of the README (serve, test, lab), plus the steps they are made of.
.PHONY: serve test lab setup export docs clean

serve: setup          ## set up .venv if needed, then serve the embedded default model
	.venv/bin/minisgl serve

test:                 ## set up .venv if needed, then run every test (notebooks and tests/)
	scripts/test.sh

lab:                  ## set up .venv if needed, then open the chapters in JupyterLab (127.0.0.1 only; PORT=8888)
	scripts/lab.sh

setup:
	scripts/setup_env.sh

export:               ## regenerate minisgl/ and README.md from nbs/
	.venv/bin/nbdev_clean && .venv/bin/nbdev_export && .venv/bin/python scripts/render_readme.py

docs:                 ## build the documentation site into docs/
	scripts/build_docs.sh

clean:
	rm -rf build _proc _docs
