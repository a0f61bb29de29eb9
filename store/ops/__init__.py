"""Operations over whole checkpoints: save, redivide, convert, verify."""
