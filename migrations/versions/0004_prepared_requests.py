"""Requests and batch lines keep the request as prepared at intake (prompt token ids, sampling
parameters, what the answer needs), so the worker never parses a body again

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 21:30:00

"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


revision: str = '0004'
down_revision: Union[str, Sequence[str], None] = '0003'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.add_column('requests', sa.Column('prepared', sa.JSON(), nullable=True))
    op.add_column('batch_items', sa.Column('prepared', sa.JSON(), nullable=True))


def downgrade() -> None:
    for table in ('requests', 'batch_items'):
        with op.batch_alter_table(table) as batch:  # SQLite rebuilds the table to drop a column
            batch.drop_column('prepared')
