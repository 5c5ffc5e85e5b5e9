"""One request's size limits (choices, tokens), per key, and kept by each batch for its lines

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 22:50:00

"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


revision: str = '0005'
down_revision: Union[str, Sequence[str], None] = '0004'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

COLUMNS = ('max_request_choices', 'max_request_tokens')


def upgrade() -> None:
    for table in ('api_keys', 'batches'):
        for column in COLUMNS:
            op.add_column(table, sa.Column(column, sa.Integer(), nullable=True))


def downgrade() -> None:
    for table in ('api_keys', 'batches'):
        with op.batch_alter_table(table) as batch:  # SQLite rebuilds the table to drop a column
            for column in COLUMNS:
                batch.drop_column(column)
