"""The tokens a batch's finished lines generated, counted as each line ends (the dashboard's tokens/s)

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02 07:30:00

"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


revision: str = '0006'
down_revision: Union[str, Sequence[str], None] = '0005'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.add_column('batches', sa.Column('completion_tokens', sa.Integer(), nullable=False, server_default='0'))


def downgrade() -> None:
    with op.batch_alter_table('batches') as batch:  # SQLite rebuilds the table to drop a column
        batch.drop_column('completion_tokens')
