"""A batch remembers its creating key's max_tokens limit, so its lines are held to it too

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29 20:30:00

"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


revision: str = '0003'
down_revision: Union[str, Sequence[str], None] = '0002'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.add_column('batches', sa.Column('max_tokens_limit', sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('batches') as batch:  # SQLite rebuilds the table to drop a column
        batch.drop_column('max_tokens_limit')
