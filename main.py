"""Train a character-level GPT: `python main.py [key=value ...]`.

The command line is mingpt/cli.py, the run mingpt/run.py, the configuration mingpt/config.py
and conf/.
"""

from mingpt import stopping

stopping.install()  # first: Ctrl-C during the imports below ends the process with one line

from mingpt.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
