"""The `mistral3` model family: its entry (`model`), state-dict adapter (`adapter`), Pixtral vision patches (`vision`) and test helpers (`testing`)."""
